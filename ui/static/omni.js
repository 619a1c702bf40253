// omni-rt pages: what they share (no build step, nothing from outside the server).
"use strict";
const omni = (() => {
  const $ = (id) => document.getElementById(id);
  const KEY = "omni-rt.api-key";

  // The API key field: remembered in this browser's session storage only.
  function keyField(id) {
    const el = $(id);
    el.value = sessionStorage.getItem(KEY) || "";
    el.addEventListener("change", () => sessionStorage.setItem(KEY, el.value.trim()));
    return () => el.value.trim();
  }

  // A WebSocket to this server (wss on https pages). Browsers cannot set headers on a
  // WebSocket: the key travels as OpenAI's browser clients send it, in a subprotocol.
  function socket(path, key) {
    const url = (location.protocol === "https:" ? "wss://" : "ws://") + location.host + path;
    const protocols = ["realtime"];
    if (key) protocols.push("openai-insecure-api-key." + key);
    return new WebSocket(url, protocols);
  }

  function headers(key) { return key ? { Authorization: "Bearer " + key } : {}; }

  // Server-Sent Events over fetch (EventSource cannot send the Authorization header).
  async function events(path, key, onEvent, signal) {
    const r = await fetch(path, { headers: headers(key), signal });
    if (!r.ok) {
      let msg = r.status + " " + r.statusText;
      try { msg = (await r.json()).error.message; } catch (_) { /* not JSON */ }
      throw new Error(msg);
    }
    const reader = r.body.getReader(), dec = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buf += dec.decode(value, { stream: true });
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const block = buf.slice(0, cut); buf = buf.slice(cut + 2);
        let name = "message", data = "";
        for (const line of block.split("\n")) {
          if (line.startsWith("event: ")) name = line.slice(7);
          else if (line.startsWith("data: ")) data += line.slice(6);
        }
        onEvent(name, JSON.parse(data));
      }
    }
  }

  function log(id, text, cls) {
    const box = $(id), p = document.createElement("p");
    p.textContent = new Date().toLocaleTimeString() + "  " + text;
    if (cls) p.className = cls;
    box.appendChild(p);
    while (box.childNodes.length > 200) box.removeChild(box.firstChild);
    box.scrollTop = 1e9;
  }

  function pill(el, text, kind) { el.textContent = text; el.className = "pill " + (kind || ""); }

  // Draws base64 frames on a canvas, in order, without piling up decodes.
  function painter(canvas) {
    const ctx = canvas.getContext("2d");
    return async (format, b64) => {
      const blob = await (await fetch(`data:image/${format};base64,${b64}`)).blob();
      const bmp = await createImageBitmap(blob);
      if (canvas.width !== bmp.width || canvas.height !== bmp.height) { canvas.width = bmp.width; canvas.height = bmp.height; }
      ctx.drawImage(bmp, 0, 0);
      bmp.close();
    };
  }

  // A digest of what a canvas shows (tests and people can tell frames apart).
  function canvasDigest(canvas) {
    const d = canvas.getContext("2d").getImageData(0, 0, canvas.width, canvas.height).data;
    let h = 2166136261;
    for (let i = 0; i < d.length; i += 7) { h ^= d[i]; h = Math.imul(h, 16777619); }
    return (h >>> 0).toString(16);
  }

  function fmt(x, digits = 1, unit = "") { return x === null || x === undefined ? "–" : Number(x).toFixed(digits) + unit; }

  return { $, keyField, socket, headers, events, log, pill, painter, canvasDigest, fmt };
})();
