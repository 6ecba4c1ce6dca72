// The chat playground: a conversation streamed from /v1/chat/completions, a badge per answer
// (TTFT, tok/s, cached tokens by tier, cache writes) and the last prompt with its cached part highlighted.
"use strict";

const conversation = []; // {role, content}, the system prompt excluded
let running = null; // the AbortController of the request in flight
const $ = (id) => document.getElementById(id);

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
  const last = conversation[conversation.length - 1];
  $("regenerate").disabled = busy || !last || last.role !== "assistant";
}

function addMessage(role, content) {
  const text = el("div", { class: "content" }, content);
  const item = el("li", { class: role }, el("div", { class: "role" }, role), text);
  $("messages").append(item);
  return { item, text };
}

function requestBody(messages) {
  const body = {
    model: $("model").value, messages, stream: true, stream_options: { include_usage: true },
    temperature: Number($("temperature").value), max_tokens: Number($("max-tokens").value),
  };
  const kind = $("constraint").value;
  const text = $("constraint-text").value.trim();
  if (kind === "json_schema") {
    body.response_format = { type: "json_schema", json_schema: { name: "answer", schema: JSON.parse(text || "{}") } };
  } else if (kind === "regex") {
    body.regex = text;
  }
  return body;
}

// Read an SSE body; call onChunk with each decoded `data:` event until [DONE].
async function readEvents(response, onChunk) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        onChunk(chunk);
      }
    }
  }
}

// The cached tokens by the tier that served them (device, host, disk): they sum to cached_tokens.
function tierSplit(details) {
  const by = details.cached_tokens_by_tier || {};
  return { device: by.device || 0, host: by.host || 0, disk: by.disk || 0 };
}

function badgeText(t) {
  const parts = [];
  if (t.ttftMs !== null) parts.push("TTFT " + Math.round(t.ttftMs) + " ms");
  if (t.tokensPerS !== null) parts.push(t.tokensPerS.toFixed(1) + " tok/s");
  if (t.usage) {
    const u = t.usage;
    const d = u.prompt_tokens_details || {};
    const cached = d.cached_tokens || 0;
    parts.push("cached " + cached + " / " + u.prompt_tokens + " prompt tokens");
    const split = Object.entries(tierSplit(d)).filter(([, n]) => n > 0).map(([tier, n]) => tier + " " + n);
    if (split.length) parts.push("from " + split.join(", "));
    if (d.cache_write_tokens !== undefined) parts.push("wrote " + d.cache_write_tokens + " to the cache");
  }
  if (t.stopped) parts.push("stopped");
  return parts.join(" · ");
}

async function generate() {
  const system = $("system").value.trim();
  const messages = [...(system ? [{ role: "system", content: system }] : []), ...conversation];
  const { item, text } = addMessage("assistant", "");
  const badge = el("span", { class: "badge", "data-testid": "badge" }, "waiting for the first token…");
  item.append(badge);
  const t = { start: performance.now(), first: null, last: null, ttftMs: null, tokensPerS: null, usage: null, stopped: false };
  running = new AbortController();
  setBusy(true);
  $("status").textContent = "";
  let answer = "";
  try {
    const response = await postJson("/v1/chat/completions", requestBody(messages), running.signal);
    await readEvents(response, (chunk) => {
      const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
      if (delta && delta.content) {
        const now = performance.now();
        if (t.first === null) t.first = now;
        t.last = now;
        answer += delta.content;
        text.textContent = answer;
      }
      if (chunk.usage) t.usage = chunk.usage;
    });
  } catch (e) {
    if (e.name === "AbortError") t.stopped = true;
    else $("status").textContent = "Error: " + e.message;
  } finally {
    running = null;
  }
  if (t.first !== null) t.ttftMs = t.first - t.start;
  const n = t.usage ? t.usage.completion_tokens : 0;
  if (n > 1 && t.last > t.first) t.tokensPerS = (n - 1) / ((t.last - t.first) / 1000);
  badge.textContent = badgeText(t);
  if (t.usage) {
    const d = t.usage.prompt_tokens_details || {};
    badge.dataset.cachedTokens = d.cached_tokens || 0;
    badge.dataset.promptTokens = t.usage.prompt_tokens;
    for (const [tier, n] of Object.entries(tierSplit(d))) badge.dataset["cached" + tier[0].toUpperCase() + tier.slice(1)] = n;
    if (d.cache_write_tokens !== undefined) badge.dataset.cacheWrites = d.cache_write_tokens;
  }
  badge.dataset.done = t.stopped ? "stopped" : "finished";
  if (!answer && !t.stopped && !t.usage) { // refused (the error is shown): nothing to keep
    item.remove();
    setBusy(false);
    return;
  }
  conversation.push({ role: "assistant", content: answer });
  setBusy(false);
  if (t.usage) showPrompt(messages, (t.usage.prompt_tokens_details || {}).cached_tokens || 0).catch((e) => {
    $("prompt-text").textContent = "(could not render the prompt: " + e.message + ")";
  });
}

// Render the prompt as the chat template made it, the first `cached` tokens marked.
async function showPrompt(messages, cached) {
  const model = $("model").value;
  const tokenized = await (await postJson("/tokenize", { model, messages })).json();
  const detok = async (tokens) =>
    tokens.length ? (await (await postJson("/detokenize", { model, tokens })).json()).prompt : "";
  const [head, tail] = await Promise.all([
    detok(tokenized.tokens.slice(0, cached)), detok(tokenized.tokens.slice(cached)),
  ]);
  const mark = el("mark", { class: "cached", "data-testid": "cached-prompt" }, head);
  $("prompt-text").replaceChildren(mark, el("span", {}, tail));
}

async function send() {
  const input = $("input");
  const content = input.value.trim();
  if (!content || running) return;
  input.value = "";
  conversation.push({ role: "user", content });
  addMessage("user", content);
  await generate();
}

async function regenerate() {
  if (running || conversation[conversation.length - 1].role !== "assistant") return;
  conversation.pop();
  $("messages").lastElementChild.remove();
  await generate();
}

function clearChat() {
  if (running) running.abort();
  conversation.length = 0;
  $("messages").replaceChildren();
  $("prompt-text").textContent = "";
  setBusy(false);
}

async function loadModel() {
  try {
    const models = await getJson("/v1/models");
    $("model").value = models.data[0].id;
  } catch (e) {
    $("status").textContent = "Cannot list the models (" + e.message + "); is the API key right?";
  }
}

setUpKeyField();
$("api-key").addEventListener("change", loadModel);
$("settings").addEventListener("submit", (e) => e.preventDefault());
$("send").addEventListener("click", send);
$("stop").addEventListener("click", () => running && running.abort());
$("regenerate").addEventListener("click", regenerate);
$("clear").addEventListener("click", clearChat);
$("input").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); send(); }
});
loadModel();
