/* fedkey web keyboard: the page. Plain JS, no build step.
 *
 * Two modes: "server" sends the text before the caret over WS /ws/suggest on every keystroke;
 * "browser" runs the same ONNX model with onnxruntime-web (wasm, one thread), mixed with the
 * export's n-gram when it has one (ngram.js), and the port of the suggestion logic in
 * suggest.js, so keystrokes never leave the device. In browser mode the bar also learns the
 * user's own words from the messages sent (personal.js), kept in this browser's localStorage.
 * window.fedkeyTimings holds per-keystroke times in ms (server: round trip; browser: compute).
 */
(() => {
  "use strict";

  const $ = (id) => document.getElementById(id);
  const Panel = window.FedkeyPanel;
  const input = $("input");
  const slots = Array.from(document.querySelectorAll('[data-testid="suggestion"]'));
  const modeSelect = $("mode");
  const statusEl = $("status");
  const MAX_SEND = 4000; // characters before the caret sent to the server (it reads the last 1000)
  const W = "\\p{L}\\p{N}_";
  const PARTIAL_RE = new RegExp(`[${W}]+(?:['\\-.\u2019][${W}]+)*['\\-\u2019]?$`, "u");

  const timings = { server: [], browser: [], browserModel: [] };
  window.fedkeyTimings = timings;
  const state = {
    mode: "server",
    info: null,
    serverReady: false,
    browserReady: false,
    browserRound: null,
    suggestions: [],
    suggestedFor: null, // the text before the caret the bar answers (null: none yet)
    round: null,
    ngramError: null, // why browser mode runs without the export's n-gram
  };
  window.fedkey = state;

  function setStatus(text, error = false) {
    statusEl.textContent = text;
    statusEl.classList.toggle("error", error);
  }

  // Server mode's status line; it keeps saying why browser mode is unavailable, whichever of
  // the WebSocket and /api/info answers first.
  function serverStatus() {
    const bm = state.info && state.info.browser_mode;
    return bm && !bm.available
      ? `suggestions from the server · browser mode unavailable: ${bm.reason}`
      : "suggestions from the server";
  }

  // ---------------------------------------------------------------------------------------------
  // The on-screen keyboard
  // ---------------------------------------------------------------------------------------------
  const LAYOUT = [
    ["q", "w", "e", "r", "t", "y", "u", "i", "o", "p"],
    ["a", "s", "d", "f", "g", "h", "j", "k", "l", "'"],
    ["z", "x", "c", "v", "b", "n", "m", "backspace"],
    [",", "space", ".", "?", "send"],
  ];
  const LABELS = { backspace: "⌫", space: "space", send: "send" };
  const WIDE = new Set(["backspace", "send"]);

  function buildKeyboard() {
    const keys = $("keys");
    for (const row of LAYOUT) {
      const div = document.createElement("div");
      div.className = "row";
      for (const k of row) {
        const b = document.createElement("button");
        b.type = "button";
        b.className = "key" + (WIDE.has(k) ? " wide" : "") + (k === "space" ? " space" : "");
        b.dataset.key = k;
        b.setAttribute("data-testid", `key-${k}`);
        b.setAttribute("aria-label", k);
        b.textContent = LABELS[k] || k;
        div.appendChild(b);
      }
      keys.appendChild(div);
    }
    // Keep the focus (and the caret) in the text area when a key is pressed.
    keys.addEventListener("mousedown", (e) => e.preventDefault());
    keys.addEventListener("click", (e) => {
      const b = e.target.closest(".key");
      if (!b) return;
      pressKey(b.dataset.key);
    });
  }

  function pressKey(k) {
    if (k === "backspace") backspace();
    else if (k === "send") send();
    else insertText(k === "space" ? " " : k);
  }

  function caret() {
    return input.selectionStart ?? input.value.length;
  }

  function insertText(str) {
    const s = input.selectionStart ?? input.value.length;
    const e = input.selectionEnd ?? s;
    input.setRangeText(str, s, e, "end");
    changed();
  }

  function backspace() {
    let s = input.selectionStart ?? input.value.length;
    const e = input.selectionEnd ?? s;
    if (s === e) {
      if (s === 0) return;
      const code = input.value.charCodeAt(s - 1);
      s -= code >= 0xdc00 && code <= 0xdfff && s >= 2 ? 2 : 1; // a surrogate pair is one character
    }
    input.setRangeText("", s, e, "end");
    changed();
  }

  // Enter sends the message (Shift+Enter starts a new line).
  const isSendKey = (e) => e.key === "Enter" && !e.shiftKey && !e.isComposing;

  input.addEventListener("keydown", (e) => {
    if (!isSendKey(e)) return;
    e.preventDefault();
    send();
  });

  // A key typed while the focus is elsewhere (the mode switch, the page) still types.
  document.addEventListener("keydown", (e) => {
    const t = e.target;
    if (t === input || t.tagName === "SELECT" || t.tagName === "INPUT") return;
    if (e.ctrlKey || e.metaKey || e.altKey) return;
    if (e.key === "Backspace") backspace();
    else if (isSendKey(e)) send();
    else if (e.key.length === 1) insertText(e.key);
    else return;
    e.preventDefault();
    input.focus();
  });

  /** Send the message: the text box empties, and in browser mode its words are learned. */
  function send() {
    const message = input.value;
    if (!message.trim()) return;
    learnWords(message);
    input.value = "";
    input.focus();
    changed();
  }

  // ---------------------------------------------------------------------------------------------
  // My words: the personal cache (personal.js), browser mode only, in this browser's storage
  // ---------------------------------------------------------------------------------------------
  const P = window.FedkeyPersonal;
  const ENABLED_KEY = "fedkey.personal.enabled";
  const storage = pageStorage();
  const personal = {
    cache: P.PersonalCache.load(storage),
    params: P.personalParams(null), // model.json's "personal" once browser mode loads it
    enabled: storage.getItem(ENABLED_KEY) !== "0", // on unless the user turned it off
  };

  /** localStorage, or a store that forgets on reload where the browser refuses it. */
  function pageStorage() {
    try {
      const s = window.localStorage;
      s.getItem(P.STORAGE_KEY);
      return s;
    } catch {
      const m = new Map();
      return {
        getItem: (k) => (m.has(k) ? m.get(k) : null),
        setItem: (k, v) => m.set(k, String(v)),
        removeItem: (k) => m.delete(k),
      };
    }
  }

  function personalActive() {
    return state.mode === "browser" && personal.enabled;
  }

  /** What the bar mixes in: the cache and its parameters, or null. */
  function personalForBar() {
    return personalActive() && personal.cache.size ? personal : null;
  }

  function savePersonal() {
    try {
      personal.cache.save(storage);
    } catch (e) {
      setStatus(`could not keep your words in this browser: ${e.message || e}`, true);
    }
  }

  function learnWords(message) {
    if (!personalActive()) return;
    personal.cache.learn(message);
    savePersonal();
    showPersonal();
  }

  function personalNote() {
    if (state.mode !== "browser") return "in browser mode, where typing stays on the device";
    if (!personal.enabled) return "off: nothing learned or suggested";
    const n = personal.cache.size;
    return `${n} word${n === 1 ? "" : "s"} learned from what you send, kept here`;
  }

  function showPersonal() {
    const toggle = $("personal-switch");
    toggle.checked = personal.enabled;
    toggle.disabled = state.mode !== "browser";
    $("personal-clear").disabled = personal.cache.size === 0;
    const note = $("personal-note");
    note.textContent = personalNote();
    note.title = note.textContent; // a short screen may cut it
  }

  $("personal-switch").addEventListener("change", (e) => {
    personal.enabled = e.target.checked;
    storage.setItem(ENABLED_KEY, personal.enabled ? "1" : "0");
    showPersonal();
    input.focus();
    changed(true);
  });

  $("personal-clear").addEventListener("click", () => {
    personal.cache.clear();
    savePersonal();
    showPersonal();
    input.focus();
    changed(true);
  });

  // ---------------------------------------------------------------------------------------------
  // Suggestions
  // ---------------------------------------------------------------------------------------------
  let seq = 0;
  let lastText = null;

  function textBeforeCaret() {
    return input.value.slice(0, caret());
  }

  function changed(force = false) {
    const text = textBeforeCaret();
    if (!force && text === lastText) return;
    lastText = text;
    seq += 1;
    if (state.mode === "browser") browserSuggest(text, seq);
    else serverSuggest(text, seq);
  }

  input.addEventListener("input", () => changed());
  for (const ev of ["keyup", "click", "select"]) input.addEventListener(ev, () => changed());

  /** Show `list` in the bar; `text`: the text it answers. */
  function render(list, round, text = null) {
    state.suggestions = list;
    state.suggestedFor = text;
    slots.forEach((b, i) => {
      b.textContent = list[i] || "";
      b.dataset.word = list[i] || "";
      b.disabled = !list[i];
    });
    if (round !== undefined && round !== null) setRound(round);
  }

  function accept(word) {
    const end = caret();
    const before = input.value.slice(0, end);
    const m = PARTIAL_RE.exec(before);
    const start = m ? end - m[0].length : end;
    let w = word;
    if (m && /^\p{Lu}/u.test(m[0])) w = w.charAt(0).toUpperCase() + w.slice(1);
    if (!m && before && !/\s$/u.test(before)) w = " " + w; // "hello," + word
    input.setRangeText(w + " ", start, input.selectionEnd ?? end, "end");
    input.focus();
    changed();
  }

  for (const b of slots) {
    b.addEventListener("mousedown", (e) => e.preventDefault());
    b.addEventListener("click", () => {
      if (b.dataset.word) accept(b.dataset.word);
    });
  }

  // -- server mode -------------------------------------------------------------------------------
  let ws = null;
  let wsBackoff = 250;
  const sentAt = new Map();
  let queued = null;

  function connectSuggest() {
    const url = `${location.protocol === "https:" ? "wss" : "ws"}://${location.host}/ws/suggest`;
    ws = new WebSocket(url);
    ws.onopen = () => {
      wsBackoff = 250;
      state.serverReady = true;
      if (state.mode === "server") {
        setStatus(serverStatus());
        if (queued) serverSend(...queued);
        else changed(true);
      }
    };
    ws.onmessage = (ev) => {
      let msg;
      try {
        msg = JSON.parse(ev.data);
      } catch {
        return;
      }
      const t0 = sentAt.get(msg.id);
      sentAt.delete(msg.id);
      if (state.mode !== "server") return;
      if (msg.error) {
        setStatus(msg.error, true);
        if (msg.id === seq) render([]);
        return;
      }
      if (t0 !== undefined) timings.server.push(performance.now() - t0);
      if (msg.id === seq) render(msg.suggestions, msg.round, lastText);
    };
    ws.onclose = () => {
      state.serverReady = false;
      if (state.mode === "server") setStatus("connection to the server lost, retrying…", true);
      setTimeout(connectSuggest, wsBackoff);
      wsBackoff = Math.min(wsBackoff * 2, 5000);
    };
  }

  function serverSend(text, id) {
    if (!ws || ws.readyState !== WebSocket.OPEN) {
      queued = [text, id];
      return;
    }
    queued = null;
    sentAt.set(id, performance.now());
    if (sentAt.size > 1000) sentAt.clear();
    ws.send(JSON.stringify({ text: text.length > MAX_SEND ? text.slice(-MAX_SEND) : text, id }));
  }

  function serverSuggest(text, id) {
    serverSend(text, id);
  }

  // -- browser mode ------------------------------------------------------------------------------
  let ortPromise = null;
  let bSuggester = null;
  let bSession = null;
  let busy = false;
  let pending = null;

  function loadOrt() {
    if (window.ort) return Promise.resolve(window.ort);
    if (!ortPromise) {
      const src = (state.info && state.info.browser_mode.script) || "/vendor/ort.wasm.min.js";
      ortPromise = new Promise((resolve, reject) => {
        const s = document.createElement("script");
        s.src = src;
        s.onload = () => (window.ort ? resolve(window.ort) : reject(new Error("ort missing")));
        s.onerror = () => {
          ortPromise = null;
          reject(new Error(`could not load ${src}`));
        };
        document.head.appendChild(s);
      });
    }
    return ortPromise;
  }

  /** GET `url` -> {bytes, same: whether it is round `round`'s (X-Fedkey-Round), error}. */
  async function fetchBytes(url, round) {
    const r = await fetch(url, { cache: "no-store" });
    const same = r.headers.get("X-Fedkey-Round") === String(round);
    if (!r.ok) {
      const body = await r.json().catch(() => ({}));
      return { bytes: null, same, error: body.detail || `GET ${url}: ${r.status}` };
    }
    return { bytes: new Uint8Array(await r.arrayBuffer()), same, error: null };
  }

  /** model.json, model.onnx and (when model.json names one) ngram.safetensors, all of one round;
   * an n-gram the server does not use (its 404 says why) leaves the model alone, as there. */
  async function fetchModel() {
    for (let attempt = 0; attempt < 5; attempt++) {
      const meta = await (await fetch("/model.json", { cache: "no-store" })).json();
      const onnx = await fetchBytes("/model.onnx", meta.round);
      if (onnx.error) throw new Error(onnx.error);
      const ngram = meta.ngram
        ? await fetchBytes("/ngram.safetensors", meta.round)
        : { bytes: null, same: true, error: null };
      if (onnx.same && ngram.same) return { meta, onnx: onnx.bytes, ngram };
      // A hot reload happened between the requests: fetch them again.
    }
    throw new Error("the model changed while it was downloaded; try again");
  }

  /** The NGram to mix in, or null and why not (a file the server does not use, or refused). */
  async function browserNgram(meta, fetched) {
    if (!meta.ngram) return [null, null];
    if (fetched.error) return [null, fetched.error];
    const words = (meta.tokenizer && meta.tokenizer.words) || [];
    try {
      return [await window.FedkeyNgram.loadNGram(fetched.bytes, words, meta.ngram.sha256), null];
    } catch (e) {
      return [null, `the n-gram is not used: ${e.message || e}`];
    }
  }

  async function loadBrowserModel() {
    state.browserReady = false;
    const t0 = performance.now();
    const ort = await loadOrt();
    ort.env.wasm.numThreads = 1; // no SharedArrayBuffer needed
    ort.env.wasm.proxy = false;
    ort.env.wasm.wasmPaths = "/vendor/";
    const fetched = await fetchModel();
    const meta = fetched.meta;
    const session = await ort.InferenceSession.create(fetched.onnx, {
      executionProviders: ["wasm"],
      graphOptimizationLevel: "all",
    });
    const [ngram, ngramError] = await browserNgram(meta, fetched.ngram);
    state.ngramError = ngramError;
    const sugg = await new window.FedkeySuggest.Suggester(ort, session, meta, { ngram }).init();
    personal.params = P.personalParams(meta.personal);
    bSuggester = sugg;
    bSession = sugg.newSession();
    state.browserRound = meta.round;
    state.browserReady = true;
    state.browserLoadMs = performance.now() - t0;
    return meta;
  }

  async function browserSuggest(text, id) {
    if (!bSession) {
      pending = [text, id];
      return;
    }
    if (busy) {
      pending = [text, id]; // only the latest text matters
      return;
    }
    busy = true;
    try {
      let job = [text, id];
      while (job) {
        const [t, i] = job;
        pending = null;
        const session = bSession;
        const calls = session.suggester.calls;
        const t0 = performance.now();
        const res = await session.suggest(t, personalForBar());
        const dt = performance.now() - t0;
        timings.browser.push(dt);
        if (session.suggester.calls > calls) timings.browserModel.push(dt);
        if (state.mode === "browser" && i === seq) render(res.suggestions, res.round, t);
        job = pending;
      }
    } catch (e) {
      setStatus(`in-browser model failed: ${e.message || e}`, true);
    } finally {
      busy = false;
    }
  }

  function browserStatus() {
    if (state.ngramError) return `model runs in this browser (wasm), alone: ${state.ngramError}`;
    const what = bSuggester && bSuggester.ngram ? "model and n-gram run" : "model runs";
    return `${what} in this browser (wasm): keystrokes stay here`;
  }

  async function setMode(mode) {
    if (mode === "browser") {
      const bm = state.info && state.info.browser_mode;
      if (bm && !bm.available) {
        setStatus(`browser mode unavailable: ${bm.reason}`, true);
        modeSelect.value = "server";
        return;
      }
      state.mode = "browser";
      document.body.dataset.mode = "browser";
      $("served-by").textContent = "browser";
      showPersonal();
      render([]);
      if (!bSession || state.browserRound !== state.round) {
        setStatus("loading the model into the browser…");
        try {
          const meta = await loadBrowserModel();
          showModel({ ...meta, ...(meta.metrics || {}) });
        } catch (e) {
          setStatus(`browser mode failed: ${e.message || e}`, true);
          modeSelect.value = "server";
          return setMode("server");
        }
      }
      setStatus(browserStatus(), Boolean(state.ngramError));
      showServed(); // the browser's mixture may not be the server's
      changed(true);
    } else {
      state.mode = "server";
      document.body.dataset.mode = "server";
      $("served-by").textContent = "server";
      showPersonal();
      showServed();
      setStatus(state.serverReady ? serverStatus() : "connecting…");
      changed(true);
    }
  }

  modeSelect.addEventListener("change", async () => {
    await setMode(modeSelect.value);
    input.focus();
  });

  // ---------------------------------------------------------------------------------------------
  // The model panel and the chart (their text and drawing: panel.js)
  // ---------------------------------------------------------------------------------------------
  const rows = new Map(); // round -> {round, and the ROW_FIELDS known of it}
  // What the panel reads of a round: the chart's perplexities, and for the line against round 0
  // the bar's top-1 and the mixture's (the model with the keyboard's n-gram) scores.
  const ROW_FIELDS = [
    "val_ppl",
    "test_ppl",
    "bar_top1",
    "mix_val_ppl",
    "mix_test_ppl",
    "mix_bar_top1",
  ];
  let served = null; // the served model's facts (model.json or /api/info), for its note

  function setRound(r) {
    state.round = r;
    $("round").textContent = r === null || r === undefined ? "–" : String(r);
    drawChart();
  }

  function drawChart() {
    Panel.drawChart($("chart"), rows, state.round);
  }

  function showPrivacy(p) {
    const show = (id, text) => {
      $(id).textContent = text;
      $(id).hidden = !text;
    };
    const [[main, tail], detail] = Panel.privacyText(p);
    const value = $("privacy");
    value.textContent = main;
    tail.forEach((part, i) => {
      if (i) value.append(" · ");
      const keep = document.createElement("span"); // "(delta 1e-5)" never breaks at its hyphen
      keep.className = "nowrap";
      keep.textContent = part;
      value.append(keep);
    });
    value.title = detail; // short screens hide the detail line
    show("privacy-detail", detail);
    const [bounding, boundingDetail] = Panel.boundingText(p);
    $("bounding").textContent = bounding;
    $("bounding").title = boundingDetail;
    $("bounding-row").hidden = !bounding;
    show("bounding-detail", boundingDetail);
  }

  /** Whether the suggestions mix in the export's n-gram (in browser mode: the browser's). */
  function mixesNgram() {
    if (state.mode === "browser") return Boolean(bSuggester && bSuggester.ngram);
    const n = state.info && state.info.ngram;
    return Boolean(n && n.active);
  }

  function showServed() {
    $("served-note").textContent = Panel.servedNote(served, rows);
    const [text, title] = Panel.baselineText(rows, served && served.round, mixesNgram());
    const line = $("baseline");
    line.textContent = text;
    line.title = title;
    line.hidden = !text;
  }

  /** Round `r`'s row, what `fields` holds of ROW_FIELDS laid over what was known of it. */
  function mergeRow(r, fields) {
    const row = { ...(rows.get(r) || {}), round: r };
    for (const k of ROW_FIELDS) if (fields[k] !== undefined) row[k] = fields[k];
    rows.set(r, row);
  }

  function showModel(m) {
    served = m;
    setRound(m.round);
    $("strategy").textContent = m.strategy || "–";
    showPrivacy(m.privacy);
    const ppl = m.perplexity ?? m.test_ppl ?? m.val_ppl;
    $("perplexity").textContent = Panel.fmt(ppl) + (m.int8 ? " · int8" : "");
    if (m.round !== null && m.round !== undefined && (m.val_ppl != null || m.test_ppl != null)) {
      const row = rows.get(m.round) || {};
      mergeRow(m.round, { val_ppl: row.val_ppl ?? m.val_ppl, test_ppl: row.test_ppl ?? m.test_ppl });
      drawChart();
    }
    showServed();
  }

  function addRows(list) {
    for (const r of list || []) {
      if (r && typeof r.round === "number") mergeRow(r.round, r);
    }
    drawChart();
    showServed();
  }

  async function refreshInfo() {
    try {
      const info = await (await fetch("/api/info", { cache: "no-store" })).json();
      state.info = info;
      const opt = modeSelect.querySelector('option[value="browser"]');
      opt.disabled = !info.browser_mode.available;
      opt.title = info.browser_mode.reason || "";
      if (!info.browser_mode.available) {
        opt.textContent = "on this device (unavailable)";
        $("mode").title = `browser mode unavailable: ${info.browser_mode.reason}`;
      }
      if (state.mode === "server") showModel(info);
      if (!info.suggestions) setStatus(info.error, true);
      else if (state.mode === "server" && state.serverReady) setStatus(serverStatus());
      return info;
    } catch (e) {
      setStatus(`cannot reach the keyboard server: ${e.message || e}`, true);
      return null;
    }
  }

  async function refreshMetrics() {
    try {
      const r = await fetch("/api/metrics", { cache: "no-store" });
      const body = await r.json();
      if (!r.ok) {
        $("chart-source").textContent = "(federation server unreachable)";
        return;
      }
      $("chart-source").textContent = body.source === "federation" ? "· live" : "· served models";
      addRows(body.rounds);
    } catch {
      /* the chart keeps what it has */
    }
  }

  let evBackoff = 500;

  function connectEvents() {
    const url = `${location.protocol === "https:" ? "wss" : "ws"}://${location.host}/ws/events`;
    const es = new WebSocket(url);
    es.onopen = () => (evBackoff = 500);
    es.onmessage = async (ev) => {
      let e;
      try {
        e = JSON.parse(ev.data);
      } catch {
        return;
      }
      if (e.type === "round_aggregated") {
        addRows([e]);
      } else if (e.type === "model_loaded") {
        if (state.mode === "server") showModel(e);
        else addRows([e]);
        await refreshInfo();
        refreshMetrics(); // the new round's row: the line against round 0 reads its top-1
        if (state.mode === "browser" && state.browserRound !== e.round) {
          try {
            const meta = await loadBrowserModel();
            showModel({ ...meta, ...(meta.metrics || {}) });
            setStatus(browserStatus(), Boolean(state.ngramError));
            changed(true);
          } catch (err) {
            setStatus(`could not load round ${e.round} in the browser: ${err.message || err}`, true);
          }
        } else if (state.mode === "server") {
          changed(true);
        }
      } else if (e.type === "upstream" && e.connected) {
        refreshMetrics();
      }
    };
    es.onclose = () => {
      setTimeout(connectEvents, evBackoff);
      evBackoff = Math.min(evBackoff * 2, 10000);
    };
  }

  // ---------------------------------------------------------------------------------------------
  buildKeyboard();
  showPersonal();
  render([]);
  drawChart();
  refreshInfo().then(() => refreshMetrics());
  connectSuggest();
  connectEvents();
  input.focus();
})();
