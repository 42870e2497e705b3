//! `tools`, `tool_choice` and `parallel_tool_calls` of a request: checked (a 400 names what is
//! wrong), and, when a call is forced, turned into the JSON schema the engine's grammar enforces.

use std::collections::HashMap;

use serde_json::{json, Map, Value as Json};
use voltllm_protocol::{StructuredOutput, StructuredOutputKind};

use crate::error::ApiError;

/// One function a model may call.
#[derive(Debug, Clone, PartialEq)]
pub struct FunctionTool {
    pub name: String,
    pub description: Option<String>,
    /// A JSON schema for the arguments (an object schema; `{"type": "object"}` when absent).
    pub parameters: Json,
}

/// `tool_choice`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    /// Never call; the output is content.
    None,
    /// The model decides; its own format is parsed (needs `--enable-auto-tool-choice`).
    Auto,
    /// At least one call, forced by the grammar.
    Required,
    /// This function, forced by the grammar.
    Named(String),
}

/// The tool fields of a request, checked.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolRequest {
    pub tools: Vec<FunctionTool>,
    pub choice: ToolChoice,
    /// With `required`, whether more than one call may be made.
    pub parallel: bool,
}

/// Parameter schemas by function name, for parsers that convert argument text by type.
#[derive(Debug, Clone, Default)]
pub struct ToolSchemas(HashMap<String, Json>);

impl ToolSchemas {
    /// The JSON-schema `type` of `function`'s parameter `param`, when the schema gives one.
    pub fn param_type(&self, function: &str, param: &str) -> Option<&str> {
        self.0
            .get(function)?
            .get("properties")?
            .get(param)?
            .get("type")?
            .as_str()
    }
}

/// The rule OpenAI applies to function names.
fn valid_function_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || c == b'_' || c == b'-' || c == b'.')
}

/// Checks that `schema` is a JSON schema the validator can compile (a 400 naming `param` if not).
fn check_schema(param: &str, schema: &Json) -> Result<(), ApiError> {
    if !schema.is_object() {
        return Err(ApiError::bad(
            param,
            format!("{param} must be a JSON schema object"),
        ));
    }
    jsonschema::validator_for(schema)
        .map(|_| ())
        .map_err(|e| ApiError::bad(param, format!("{param} is not a valid JSON schema: {e}")))
}

/// One function definition from its fields (`name`, `description`, `parameters`), wherever the
/// API nests them.
fn function_tool(param: &str, fields: &Map<String, Json>) -> Result<FunctionTool, ApiError> {
    let name = fields.get("name").and_then(Json::as_str).unwrap_or("");
    if !valid_function_name(name) {
        return Err(ApiError::bad(
            param,
            format!("{param}.name must be 1-64 letters, digits, '_', '-' or '.', got {name:?}"),
        ));
    }
    let description = match fields.get("description") {
        None | Some(Json::Null) => None,
        Some(Json::String(s)) => Some(s.clone()),
        Some(_) => {
            return Err(ApiError::bad(
                param,
                format!("{param}.description must be a string"),
            ))
        }
    };
    let parameters = match fields.get("parameters") {
        None | Some(Json::Null) => json!({"type": "object", "properties": {}}),
        Some(schema) => {
            check_schema(&format!("{param}.parameters"), schema)?;
            schema.clone()
        }
    };
    match fields.get("strict") {
        None | Some(Json::Null) | Some(Json::Bool(_)) => {}
        Some(_) => {
            return Err(ApiError::bad(
                param,
                format!("{param}.strict must be a boolean"),
            ))
        }
    }
    Ok(FunctionTool {
        name: name.to_string(),
        description,
        parameters,
    })
}

/// How the two APIs spell a tool: chat nests the function (`{"type": "function", "function":
/// {...}}`), the Responses API flattens it (`{"type": "function", "name": ...}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolShape {
    Chat,
    Responses,
}

fn parse_tool(i: usize, tool: &Json, shape: ToolShape) -> Result<FunctionTool, ApiError> {
    let param = format!("tools[{i}]");
    let obj = tool
        .as_object()
        .ok_or_else(|| ApiError::bad(&param, format!("{param} must be an object")))?;
    match obj.get("type").and_then(Json::as_str) {
        Some("function") => {}
        other => {
            return Err(ApiError::bad(
                &param,
                format!("{param}.type {other:?} is not supported (only \"function\" tools)"),
            ))
        }
    }
    match shape {
        ToolShape::Chat => {
            let function = obj
                .get("function")
                .and_then(Json::as_object)
                .ok_or_else(|| {
                    ApiError::bad(&param, format!("{param}.function must be an object"))
                })?;
            function_tool(&format!("{param}.function"), function)
        }
        ToolShape::Responses => function_tool(&param, obj),
    }
}

fn parse_choice(choice: Option<&Json>, has_tools: bool) -> Result<ToolChoice, ApiError> {
    let bad = |msg: String| ApiError::bad("tool_choice", msg);
    Ok(match choice {
        None | Some(Json::Null) if has_tools => ToolChoice::Auto,
        None | Some(Json::Null) => ToolChoice::None,
        Some(Json::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            other => {
                return Err(bad(format!(
                    "tool_choice must be \"none\", \"auto\", \"required\" or a named function, got {other:?}"
                )))
            }
        },
        Some(Json::Object(obj)) => {
            if obj.get("type").and_then(Json::as_str) != Some("function") {
                return Err(bad("tool_choice.type must be \"function\"".into()));
            }
            // Chat nests the name under `function`; the Responses API puts it beside `type`.
            let name = obj
                .get("function")
                .and_then(|f| f.get("name"))
                .or_else(|| obj.get("name"))
                .and_then(Json::as_str)
                .ok_or_else(|| bad("tool_choice names no function".into()))?;
            ToolChoice::Named(name.to_string())
        }
        Some(_) => return Err(bad("tool_choice must be a string or an object".into())),
    })
}

impl ToolRequest {
    /// Checks a request's tool fields; `None` when it has no tools and no forcing `tool_choice`.
    pub fn parse(
        tools: Option<&[Json]>,
        tool_choice: Option<&Json>,
        parallel_tool_calls: Option<bool>,
        shape: ToolShape,
    ) -> Result<Option<Self>, ApiError> {
        let tools: Vec<FunctionTool> = tools
            .unwrap_or_default()
            .iter()
            .enumerate()
            .map(|(i, tool)| parse_tool(i, tool, shape))
            .collect::<Result<_, _>>()?;
        for (i, tool) in tools.iter().enumerate() {
            if tools[..i].iter().any(|t| t.name == tool.name) {
                return Err(ApiError::bad(
                    "tools",
                    format!("two tools are named {:?}", tool.name),
                ));
            }
        }
        let choice = parse_choice(tool_choice, !tools.is_empty())?;
        match &choice {
            ToolChoice::Required if tools.is_empty() => {
                return Err(ApiError::bad(
                    "tool_choice",
                    "tool_choice \"required\" needs at least one tool in tools",
                ))
            }
            ToolChoice::Named(name) if !tools.iter().any(|t| &t.name == name) => {
                return Err(ApiError::bad(
                    "tool_choice",
                    format!("tool_choice names the function {name:?}, which is not in tools"),
                ))
            }
            _ => {}
        }
        if tools.is_empty() {
            return Ok(None);
        }
        Ok(Some(Self {
            tools,
            choice,
            parallel: parallel_tool_calls.unwrap_or(true),
        }))
    }

    /// The tools as the chat template expects them (the chat API's nested form).
    pub fn template_tools(&self) -> Vec<Json> {
        self.tools
            .iter()
            .map(|t| {
                let mut function = Map::new();
                function.insert("name".into(), Json::String(t.name.clone()));
                if let Some(d) = &t.description {
                    function.insert("description".into(), Json::String(d.clone()));
                }
                function.insert("parameters".into(), t.parameters.clone());
                json!({"type": "function", "function": function})
            })
            .collect()
    }

    /// Parameter schemas by name.
    pub fn schemas(&self) -> ToolSchemas {
        ToolSchemas(
            self.tools
                .iter()
                .map(|t| (t.name.clone(), t.parameters.clone()))
                .collect(),
        )
    }

    /// The JSON schema the whole output must match when a call is forced: a named function's
    /// parameters, or for `required` an array of `{"name", "arguments"}` objects (one per tool as
    /// alternatives; at most one item unless `parallel`). `None` for `auto` and `none`.
    pub fn forced_schema(&self) -> Option<Json> {
        match &self.choice {
            ToolChoice::Named(name) => self
                .tools
                .iter()
                .find(|t| &t.name == name)
                .map(|t| t.parameters.clone()),
            ToolChoice::Required => Some(self.required_schema()),
            ToolChoice::None | ToolChoice::Auto => None,
        }
    }

    fn required_schema(&self) -> Json {
        // Each parameters schema moves under the array's items, so its `$defs` move to the root
        // where its `#/$defs/...` references still find them.
        let mut defs = Map::new();
        let alternatives: Vec<Json> = self
            .tools
            .iter()
            .map(|t| {
                let mut parameters = t.parameters.clone();
                if let Some(Json::Object(own)) =
                    parameters.as_object_mut().and_then(|p| p.remove("$defs"))
                {
                    defs.extend(own);
                }
                json!({
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "enum": [t.name]},
                        "arguments": parameters,
                    },
                    "required": ["name", "arguments"],
                    "additionalProperties": false,
                })
            })
            .collect();
        let mut schema = json!({
            "type": "array",
            "minItems": 1,
            "items": {"anyOf": alternatives},
        });
        if !self.parallel {
            schema["maxItems"] = json!(1);
        }
        if !defs.is_empty() {
            schema["$defs"] = Json::Object(defs);
        }
        schema
    }
}

/// The engine constraint for a JSON schema.
pub fn json_constraint(schema: &Json) -> StructuredOutput {
    StructuredOutput::new(StructuredOutputKind::Json, schema.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn weather() -> Json {
        json!({"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}})
    }

    fn parse(tools: Json, choice: Json) -> Result<Option<ToolRequest>, ApiError> {
        let tools: Vec<Json> = serde_json::from_value(tools).unwrap();
        let choice = (!choice.is_null()).then_some(choice);
        ToolRequest::parse(Some(&tools), choice.as_ref(), None, ToolShape::Chat)
    }

    fn param_of(err: ApiError) -> String {
        err.body()["error"]["param"].as_str().unwrap().to_string()
    }

    #[test]
    fn choices_parse() {
        let r = parse(json!([weather()]), Json::Null).unwrap().unwrap();
        assert_eq!(r.choice, ToolChoice::Auto);
        let r = parse(json!([weather()]), json!("required"))
            .unwrap()
            .unwrap();
        assert_eq!(r.choice, ToolChoice::Required);
        let named = json!({"type": "function", "function": {"name": "get_weather"}});
        let r = parse(json!([weather()]), named).unwrap().unwrap();
        assert_eq!(r.choice, ToolChoice::Named("get_weather".into()));
        assert_eq!(r.forced_schema().unwrap()["required"], json!(["city"]));
        assert!(parse(json!([]), json!("none")).unwrap().is_none());
    }

    #[test]
    fn bad_tools_are_400s_naming_the_field() {
        let unknown = json!({"type": "function", "function": {"name": "nope"}});
        assert_eq!(
            param_of(parse(json!([weather()]), unknown).unwrap_err()),
            "tool_choice"
        );
        assert_eq!(
            param_of(parse(json!([]), json!("required")).unwrap_err()),
            "tool_choice"
        );
        assert_eq!(
            param_of(parse(json!([weather()]), json!("always")).unwrap_err()),
            "tool_choice"
        );
        let bad_schema = json!([{"type": "function", "function": {"name": "f",
            "parameters": {"type": "objekt"}}}]);
        assert_eq!(
            param_of(parse(bad_schema, Json::Null).unwrap_err()),
            "tools[0].function.parameters"
        );
        let bad_pattern = json!([{"type": "function", "function": {"name": "f",
            "parameters": {"type": "object", "properties": {"a": {"type": "string", "pattern": "(("}}}}}]);
        assert!(parse(bad_pattern, Json::Null).is_err());
        let not_object =
            json!([{"type": "function", "function": {"name": "f", "parameters": [1]}}]);
        assert!(parse(not_object, Json::Null).is_err());
        assert_eq!(
            param_of(parse(json!([{"type": "retrieval"}]), Json::Null).unwrap_err()),
            "tools[0]"
        );
        assert_eq!(
            param_of(
                parse(
                    json!([{"type": "function", "function": {"name": "a b"}}]),
                    Json::Null
                )
                .unwrap_err()
            ),
            "tools[0].function"
        );
        assert_eq!(
            param_of(parse(json!([weather(), weather()]), Json::Null).unwrap_err()),
            "tools"
        );
    }

    #[test]
    fn required_schema_hoists_defs_and_bounds_items() {
        let tool = json!({"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}, "$defs": {"P": {"type": "integer"}}}}});
        let tools: Vec<Json> = vec![tool, weather()];
        let r = ToolRequest::parse(
            Some(&tools),
            Some(&json!("required")),
            Some(false),
            ToolShape::Chat,
        )
        .unwrap()
        .unwrap();
        let schema = r.forced_schema().unwrap();
        assert_eq!(schema["maxItems"], 1);
        assert_eq!(schema["$defs"]["P"]["type"], "integer");
        let validator = jsonschema::validator_for(&schema).unwrap();
        assert!(validator.is_valid(&json!([{"name": "f", "arguments": {"p": 3}}])));
        assert!(!validator.is_valid(&json!([{"name": "f", "arguments": {"p": "x"}}])));
        assert!(!validator.is_valid(&json!([{"name": "g", "arguments": {}}])));
        assert!(!validator.is_valid(&json!([])));
        let parallel = ToolRequest::parse(
            Some(&tools),
            Some(&json!("required")),
            None,
            ToolShape::Chat,
        )
        .unwrap()
        .unwrap();
        assert!(parallel.forced_schema().unwrap().get("maxItems").is_none());
    }

    #[test]
    fn responses_shape_is_flat() {
        let tools =
            vec![json!({"type": "function", "name": "f", "parameters": {"type": "object"}})];
        let choice = json!({"type": "function", "name": "f"});
        let r = ToolRequest::parse(Some(&tools), Some(&choice), None, ToolShape::Responses)
            .unwrap()
            .unwrap();
        assert_eq!(r.choice, ToolChoice::Named("f".into()));
        assert_eq!(r.template_tools()[0]["function"]["name"], "f");
    }
}
