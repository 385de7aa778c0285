// One chat completion through /v1/chat/completions: the request body from the page's
// settings, and the reply, streamed (SSE, shown as it arrives) or whole, with its token counts
// and speed.

import { ApiError, apiFetch } from "./api.js";
import { sseEvents } from "./sse.js";

// The request body. settings: {model, system, temperature, topP, maxTokens, stream, schema
// (a JSON schema object or null), tools (an array or null), extra (an object merged last)}.
export function chatRequest(settings, history) {
  const messages = settings.system ? [{ role: "system", content: settings.system }, ...history] : [...history];
  const body = {
    model: settings.model,
    messages,
    temperature: settings.temperature,
    top_p: settings.topP,
    max_tokens: settings.maxTokens,
    stream: settings.stream,
  };
  if (settings.stream) body.stream_options = { include_usage: true };
  if (settings.schema) {
    body.response_format = { type: "json_schema", json_schema: { name: "output", schema: settings.schema } };
  }
  if (settings.tools) body.tools = settings.tools;
  return Object.assign(body, settings.extra || {});
}

// A reply as it grows: text, reasoning and tool calls so far, then usage and finish reason.
export class Reply {
  constructor() {
    this.content = "";
    this.reasoning = "";
    this.toolCalls = [];
    this.usage = null;
    this.finishReason = null;
    this.startMs = performance.now();
    this.firstTokenMs = null; // when the first generated text arrived (streams only)
    this.endMs = null;
    this.stopped = false;
  }

  // One streamed choice delta (OpenAI's chat.completion.chunk shape).
  addDelta(delta) {
    if (delta.content) this.content += delta.content;
    if (delta.reasoning_content) this.reasoning += delta.reasoning_content;
    for (const call of delta.tool_calls || []) {
      const index = call.index ?? this.toolCalls.length;
      const known = (this.toolCalls[index] ||= { id: call.id, type: "function", function: { name: "", arguments: "" } });
      if (call.id) known.id = call.id;
      if (call.function?.name) known.function.name += call.function.name;
      if (call.function?.arguments) known.function.arguments += call.function.arguments;
    }
    if (this.firstTokenMs === null && (delta.content || delta.reasoning_content || delta.tool_calls)) {
      this.firstTokenMs = performance.now();
    }
  }

  // The assistant message the conversation keeps.
  message() {
    const message = { role: "assistant", content: this.content || (this.toolCalls.length ? null : "") };
    if (this.toolCalls.length) message.tool_calls = this.toolCalls;
    return message;
  }

  ttftMs() {
    return this.firstTokenMs === null ? null : this.firstTokenMs - this.startMs;
  }

  // Output tokens per second after the first one (a whole reply: over the whole request).
  tokensPerSecond() {
    if (!this.usage || this.endMs === null) return null;
    const since = this.firstTokenMs ?? this.startMs;
    const seconds = (this.endMs - since) / 1000;
    const tokens = this.usage.completion_tokens - (this.firstTokenMs === null ? 0 : 1);
    return seconds > 0 && tokens > 0 ? tokens / seconds : null;
  }
}

// Runs one completion of `body`; onUpdate(reply) after every change. Resolves to the Reply
// (reply.stopped when `signal` aborted it: the fetch is cancelled, so the server aborts the
// request and frees its KV); rejects with an ApiError (or a network error).
export async function runChat(body, signal, onUpdate) {
  const reply = new Reply();
  try {
    const res = await apiFetch("/v1/chat/completions", { method: "POST", body, signal });
    if (body.stream) {
      for await (const chunk of sseEvents(res)) {
        if (chunk.error) throw new ApiError(chunk.error.code || 500, chunk.error.message);
        if (chunk.usage) reply.usage = chunk.usage;
        for (const choice of chunk.choices || []) {
          reply.addDelta(choice.delta || {});
          if (choice.finish_reason) reply.finishReason = choice.finish_reason;
        }
        onUpdate(reply);
      }
    } else {
      const out = await res.json();
      const choice = out.choices[0];
      reply.addDelta(choice.message);
      reply.firstTokenMs = null; // (a whole reply has no first-token time)
      reply.finishReason = choice.finish_reason;
      reply.usage = out.usage;
    }
  } catch (err) {
    if (err.name !== "AbortError") throw err;
    reply.stopped = true;
  }
  reply.endMs = performance.now();
  onUpdate(reply);
  return reply;
}
