// The conversation on the page: one element per message, text set as text (never as HTML),
// and the line of token counts and speed under it.

export class ConversationView {
  constructor(list, stats) {
    this.list = list;
    this.stats = stats;
  }

  clear() {
    this.list.replaceChildren();
    this.setStats("idle", "");
  }

  // A new message element of `role` ("user" or "assistant"); returns it.
  add(role, text = "") {
    const item = document.createElement("div");
    item.className = `msg ${role}`;
    const who = document.createElement("div");
    who.className = "role";
    who.textContent = role;
    const reasoning = document.createElement("pre");
    reasoning.className = "reasoning";
    reasoning.hidden = true;
    const content = document.createElement("div");
    content.className = "content";
    content.textContent = text;
    const tools = document.createElement("pre");
    tools.className = "tool-calls";
    tools.hidden = true;
    item.append(who, reasoning, content, tools);
    this.list.append(item);
    item.scrollIntoView({ block: "end" });
    return item;
  }

  // Shows `reply` (a chat.Reply) in the assistant element `item`.
  show(item, reply) {
    const reasoning = item.querySelector(".reasoning");
    reasoning.hidden = !reply.reasoning;
    reasoning.textContent = reply.reasoning;
    item.querySelector(".content").textContent = reply.content;
    const tools = item.querySelector(".tool-calls");
    tools.hidden = reply.toolCalls.length === 0;
    tools.textContent = reply.toolCalls.length ? JSON.stringify(reply.toolCalls, null, 2) : "";
    item.classList.toggle("stopped", reply.stopped);
    item.scrollIntoView({ block: "end" });
  }

  // The stats line after `reply` ended.
  showReply(reply) {
    const parts = [];
    if (reply.usage) {
      const cached = reply.usage.prompt_tokens_details?.cached_tokens ?? 0;
      parts.push(`prompt ${reply.usage.prompt_tokens} (cached ${cached})`, `completion ${reply.usage.completion_tokens}`);
    }
    const ttft = reply.ttftMs();
    if (ttft !== null) parts.push(`TTFT ${ttft.toFixed(0)} ms`);
    const speed = reply.tokensPerSecond();
    if (speed !== null) parts.push(`${speed.toFixed(1)} tok/s`);
    if (reply.stopped) parts.push("stopped");
    else if (reply.finishReason) parts.push(`finish: ${reply.finishReason}`);
    this.setStats(reply.stopped ? "stopped" : "done", parts.join(" · "));
  }

  setStats(state, text) {
    this.stats.dataset.state = state;
    this.stats.textContent = text;
  }
}
