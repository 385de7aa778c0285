// The live status panel: the server's running and queued requests, generation speed, KV cache
// use and prefix-cache hit rate, from /get_server_info polled every second.

import { describeError, getJSON } from "./api.js";

export const POLL_MS = 1000;

// What the panel shows from one /get_server_info answer and the one before it (or null):
// generation tokens/s is the change of `num_generated_tokens` over the time between the two.
export function statusFigures(info, atMs, previous) {
  const total = info.kv_total_slots;
  const cached = info.kv_evictable_slots;
  const used = total - info.kv_free_slots - cached;
  let genPerS = null;
  if (previous && atMs > previous.atMs) {
    genPerS = ((info.num_generated_tokens - previous.info.num_generated_tokens) * 1000) / (atMs - previous.atMs);
  }
  return {
    running: info.num_running_reqs,
    queued: info.num_waiting_reqs + info.num_grammar_queue_reqs,
    genPerS,
    kvUsed: used,
    kvCached: cached,
    kvTotal: total,
    hitRate: info.cache_hit_rate ?? null,
  };
}

export class StatusPanel {
  // fields: {running, queued, gen, kv, cached, hit, state}: the elements of each figure.
  constructor(fields) {
    this.fields = fields;
    this.previous = null;
    this.timer = null;
  }

  start() {
    const tick = async () => {
      await this.poll();
      this.timer = setTimeout(tick, POLL_MS);
    };
    tick();
  }

  async poll() {
    const f = this.fields;
    try {
      const info = await getJSON("/get_server_info");
      const atMs = performance.now();
      const s = statusFigures(info, atMs, this.previous);
      this.previous = { info, atMs };
      f.running.textContent = String(s.running);
      f.queued.textContent = String(s.queued);
      f.gen.textContent = s.genPerS === null ? "–" : `${s.genPerS.toFixed(1)} tok/s`;
      f.kv.textContent = `${s.kvUsed} / ${s.kvTotal} (${((100 * s.kvUsed) / s.kvTotal).toFixed(1)}%)`;
      f.kv.dataset.used = String(s.kvUsed);
      f.cached.textContent = String(s.kvCached);
      f.hit.textContent = s.hitRate === null ? "–" : `${(100 * s.hitRate).toFixed(1)}%`;
      f.state.textContent = "live";
      f.state.dataset.state = "live";
    } catch (err) {
      this.previous = null;
      f.state.textContent = describeError(err);
      f.state.dataset.state = "error";
    }
  }
}
