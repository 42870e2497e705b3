// The chat page: talks to this server's own OpenAI API (/v1/models, /v1/chat/completions with
// stream: true) and renders the answer as its server-sent events arrive. No framework, no build step.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY_STORAGE = "voltllm-api-key";

/** The conversation sent with every request: {role, content} in order. */
let history = [];
/** Aborts the answer being streamed, when there is one. */
let inFlight = null;

function authHeaders() {
  const key = $("api-key").value.trim();
  return key ? { Authorization: `Bearer ${key}` } : {};
}

function setStatus(text, isError = false) {
  $("status").textContent = text;
  $("status").classList.toggle("error", isError);
}

/** The OpenAI error message of a failed response, or its status line. */
async function errorText(response) {
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) return `${response.status}: ${body.error.message}`;
  } catch (_) {
    // not JSON: fall through
  }
  return `${response.status} ${response.statusText}`;
}

async function loadModels() {
  const select = $("model");
  try {
    const response = await fetch("/v1/models", { headers: authHeaders() });
    if (!response.ok) {
      select.replaceChildren();
      setStatus(
        response.status === 401 ? "This server needs an API key: enter it above." : await errorText(response),
        true,
      );
      return;
    }
    const previous = select.value;
    const { data } = await response.json();
    select.replaceChildren(
      ...data.map((model) => {
        const option = document.createElement("option");
        option.value = option.textContent = model.id;
        return option;
      }),
    );
    if (data.some((m) => m.id === previous)) select.value = previous;
    setStatus(`${data.length} model(s) served; context ${data[0] ? data[0].max_model_len : "?"} tokens.`);
  } catch (e) {
    setStatus(`Cannot reach the server: ${e}`, true);
  }
}

function addMessage(role, text) {
  const element = document.createElement("div");
  element.className = `message ${role}`;
  element.textContent = text;
  $("conversation").append(element);
  element.scrollIntoView({ block: "end" });
  return element;
}

/**
 * Yields the JSON payload of every `data:` event of an SSE body until `[DONE]`.
 * Events are separated by a blank line; a chunk from the network may hold part of one.
 */
async function* sseEvents(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.search(/\r?\n\r?\n/)) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end).replace(/^\r?\n\r?\n/, "");
      const data = event
        .split(/\r?\n/)
        .filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).replace(/^ /, ""))
        .join("\n");
      if (data === "[DONE]") return;
      if (data) yield JSON.parse(data);
    }
  }
}

function numberField(id, parse) {
  const value = parse($(id).value);
  if (Number.isNaN(value)) throw new Error(`${$(id).labels[0].textContent.trim()} must be a number`);
  return value;
}

/** The sampling settings of the header, checked; throws naming a field that is not a number. */
function samplingSettings() {
  return {
    temperature: numberField("temperature", parseFloat),
    max_tokens: numberField("max-tokens", (v) => parseInt(v, 10)),
  };
}

/** Sends the conversation and streams the assistant's answer into a new message. */
async function ask(question, settings) {
  const request = {
    model: $("model").value || undefined,
    messages: [...history, { role: "user", content: question }],
    ...settings,
    stream: true,
    stream_options: { include_usage: true },
  };
  addMessage("user", question);
  const answer = addMessage("assistant", "");
  answer.dataset.state = "streaming";
  const text = document.createTextNode("");
  answer.append(text);
  inFlight = new AbortController();
  $("send").textContent = "Stop";
  const started = performance.now();
  let usage = null;
  let finishReason = null;
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json", ...authHeaders() },
      body: JSON.stringify(request),
      signal: inFlight.signal,
    });
    if (!response.ok) throw new Error(await errorText(response));
    for await (const event of sseEvents(response.body)) {
      if (event.error) throw new Error(event.error.message);
      if (event.usage) usage = event.usage;
      const choice = event.choices && event.choices[0];
      if (!choice) continue;
      if (choice.delta && choice.delta.content) {
        text.appendData(choice.delta.content);
        answer.scrollIntoView({ block: "end" });
      }
      if (choice.finish_reason) finishReason = choice.finish_reason;
    }
    history = request.messages.concat({ role: "assistant", content: text.data });
    answer.dataset.state = "done";
    const seconds = (performance.now() - started) / 1000;
    const tokens = usage ? usage.completion_tokens : null;
    const meta = document.createElement("span");
    meta.className = "meta";
    meta.textContent = [
      tokens !== null ? `${tokens} tokens in ${seconds.toFixed(1)} s` : `${seconds.toFixed(1)} s`,
      finishReason === "length" ? "stopped at max tokens" : null,
    ]
      .filter(Boolean)
      .join(" · ");
    answer.append(meta);
    setStatus("");
  } catch (e) {
    const stopped = e.name === "AbortError";
    answer.dataset.state = stopped ? "stopped" : "error";
    if (!stopped) answer.classList.add("error");
    if (!text.data) text.appendData(stopped ? "(stopped)" : String(e.message || e));
    setStatus(stopped ? "Stopped." : String(e.message || e), !stopped);
  } finally {
    inFlight = null;
    $("send").textContent = "Send";
  }
}

function main() {
  $("api-key").value = sessionStorage.getItem(KEY_STORAGE) || "";
  $("api-key").addEventListener("change", () => {
    sessionStorage.setItem(KEY_STORAGE, $("api-key").value.trim());
    loadModels();
  });
  $("new-chat").addEventListener("click", () => {
    if (inFlight) inFlight.abort();
    history = [];
    $("conversation").replaceChildren();
    setStatus("");
  });
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    if (inFlight) {
      inFlight.abort();
      return;
    }
    const question = $("prompt").value.trim();
    if (!question) return;
    let settings;
    try {
      settings = samplingSettings();
    } catch (e) {
      setStatus(e.message, true);
      return;
    }
    $("prompt").value = "";
    ask(question, settings);
  });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
  loadModels();
}

main();
