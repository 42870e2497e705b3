//! The one place where failures become HTTP statuses and OpenAI-style error bodies.

use axum::http::header::RETRY_AFTER;
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;
use voltllm_chat::ChatError;
use voltllm_engine_client::EngineClientError;
use voltllm_text::TextError;

/// `Retry-After` on every 503 and 429, in seconds.
pub const RETRY_AFTER_SECONDS: &str = "1";

/// A request-level failure, carrying what the client needs to fix or retry it.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// The request is malformed or a value is out of range (400).
    #[error("{message}")]
    BadRequest {
        message: String,
        param: Option<String>,
    },
    /// Missing or wrong API key (401).
    #[error("{0}")]
    Unauthorized(String),
    /// The requested model is not served here (404).
    #[error("The model `{0}` does not exist.")]
    ModelNotFound(String),
    /// No route matches the method and path (404).
    #[error("no route for {0}")]
    RouteNotFound(String),
    /// The body is larger than the configured limit (413).
    #[error("request body is larger than {0} bytes")]
    PayloadTooLarge(usize),
    /// The waiting queue is full or the engine is gone (503); the client may retry later.
    #[error("{0}")]
    Unavailable(String),
    /// The server is shutting down and takes no new requests (503).
    #[error("the server is shutting down")]
    Draining,
    /// The engine failed the request or died (500).
    #[error("{0}")]
    Engine(String),
    /// A bug or an unexpected failure inside the server (500).
    #[error("{0}")]
    Internal(String),
}

impl ApiError {
    /// A 400 about one parameter.
    pub fn bad(param: &str, message: impl Into<String>) -> Self {
        Self::BadRequest {
            message: message.into(),
            param: Some(param.to_string()),
        }
    }

    /// The HTTP status of this error.
    pub fn status(&self) -> StatusCode {
        match self {
            Self::BadRequest { .. } => StatusCode::BAD_REQUEST,
            Self::Unauthorized(_) => StatusCode::UNAUTHORIZED,
            Self::ModelNotFound(_) | Self::RouteNotFound(_) => StatusCode::NOT_FOUND,
            Self::PayloadTooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            Self::Unavailable(_) | Self::Draining => StatusCode::SERVICE_UNAVAILABLE,
            Self::Engine(_) | Self::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The OpenAI `error.type` name.
    fn kind(&self) -> &'static str {
        match self {
            Self::BadRequest { .. } => "BadRequestError",
            Self::Unauthorized(_) => "AuthenticationError",
            Self::ModelNotFound(_) | Self::RouteNotFound(_) => "NotFoundError",
            Self::PayloadTooLarge(_) => "RequestTooLargeError",
            Self::Unavailable(_) | Self::Draining => "ServiceUnavailableError",
            Self::Engine(_) | Self::Internal(_) => "InternalServerError",
        }
    }

    /// `{"error": {"message", "type", "param", "code"}}`, also sent as an SSE event mid-stream.
    pub fn body(&self) -> serde_json::Value {
        let param = match self {
            Self::BadRequest { param, .. } => param.clone(),
            Self::ModelNotFound(_) => Some("model".to_string()),
            _ => None,
        };
        json!({"error": {
            "message": self.to_string(),
            "type": self.kind(),
            "param": param,
            "code": self.status().as_u16(),
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if self.status().is_server_error() {
            tracing::error!(error = %self, "request failed");
        }
        let status = self.status();
        let mut response = (status, Json(self.body())).into_response();
        if status == StatusCode::SERVICE_UNAVAILABLE || status == StatusCode::TOO_MANY_REQUESTS {
            // Every "not now" says when to come back: the queue, a restart or a drain clears in
            // seconds, and clients (the openai SDK among them) honour it.
            response
                .headers_mut()
                .insert(RETRY_AFTER, HeaderValue::from_static(RETRY_AFTER_SECONDS));
        }
        response
    }
}

impl From<TextError> for ApiError {
    fn from(e: TextError) -> Self {
        match e {
            TextError::EmptyStopString => Self::BadRequest {
                message: e.to_string(),
                param: None,
            },
            TextError::Encode(_) => Self::BadRequest {
                message: e.to_string(),
                param: None,
            },
            other => Self::Internal(other.to_string()),
        }
    }
}

impl From<ChatError> for ApiError {
    fn from(e: ChatError) -> Self {
        match e {
            ChatError::TemplateRaised(_)
            | ChatError::InvalidMessages(_)
            | ChatError::InvalidOptions(_)
            | ChatError::TemplateNotFound { .. } => Self::BadRequest {
                message: e.to_string(),
                param: Some("messages".into()),
            },
            ChatError::Render(_) => Self::BadRequest {
                message: e.to_string(),
                param: Some("messages".into()),
            },
            other => Self::Internal(other.to_string()),
        }
    }
}

impl From<EngineClientError> for ApiError {
    fn from(e: EngineClientError) -> Self {
        match e {
            EngineClientError::EngineDead { .. } | EngineClientError::Closed => {
                Self::Unavailable(format!("engine unavailable: {e}"))
            }
            other => Self::Engine(other.to_string()),
        }
    }
}

/// Failures that stop the whole server.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("cannot load the tokenizer: {0}")]
    Tokenizer(#[from] TextError),
    #[error("cannot load the chat template: {0}")]
    ChatTemplate(#[from] ChatError),
    #[error("cannot reach the engines: {0}")]
    Engine(#[from] EngineClientError),
    #[error("cannot listen on {address}: {source}")]
    Bind {
        address: String,
        #[source]
        source: std::io::Error,
    },
    #[error("HTTP server failed: {0}")]
    Serve(#[source] std::io::Error),
    #[error("engine died: {0}")]
    EngineDied(String),
    #[error("cannot start the async runtime: {0}")]
    Runtime(#[source] std::io::Error),
    #[error("invalid configuration: {0}")]
    Config(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_and_bodies_follow_openai() {
        let e = ApiError::bad("temperature", "temperature must be >= 0, got -1");
        assert_eq!(e.status(), StatusCode::BAD_REQUEST);
        let body = e.body();
        assert_eq!(body["error"]["type"], "BadRequestError");
        assert_eq!(body["error"]["param"], "temperature");
        assert_eq!(body["error"]["code"], 400);
        let e = ApiError::ModelNotFound("gpt-9".into());
        assert_eq!(e.status(), StatusCode::NOT_FOUND);
        assert_eq!(
            e.body()["error"]["message"],
            "The model `gpt-9` does not exist."
        );
        let dead = ApiError::from(EngineClientError::EngineDead {
            engine_index: 0,
            reason: "oom".into(),
        });
        assert_eq!(dead.status(), StatusCode::SERVICE_UNAVAILABLE);
        let failed = ApiError::from(EngineClientError::RequestFailed("x".into()));
        assert_eq!(failed.status(), StatusCode::INTERNAL_SERVER_ERROR);
    }
}
