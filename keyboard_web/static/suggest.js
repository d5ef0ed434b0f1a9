/* The suggestion logic of keyboard_web/suggest.py, ported to JavaScript for the in-browser mode.
 *
 * Same normalization (device_sim.corpora.normalize_text), same split into completed words and the
 * partial word, same context (the current sentence, windowed to 40 words), same state stack (a
 * new word costs one model step, an edit recomputes from the longest common prefix), same
 * ranking (top-3 next words without specials and punctuation, or completions of the prefix).
 * Works in a browser (window.FedkeySuggest) and in Node (module.exports) for tests.
 */
(function (root) {
  "use strict";

  const MAX_CONTEXT = 40;
  const MAX_TEXT_TAIL = 1000; // code points, as Python counts them
  const SLOTS = 3;
  const W = "\\p{L}\\p{N}_"; // Python's \w on str: alphanumeric or underscore
  const TOKEN_RE = new RegExp(`[${W}]+(?:['\\-.][${W}]+)*|([^${W}\\s])\\1*`, "gu");
  const PARTIAL_RE = new RegExp(`[${W}]+(?:['\\-.][${W}]+)*['\\-]?$`, "u");
  const ALNUM_RE = /[\p{L}\p{N}]/u;
  const APOSTROPHES = /[\u2019\u2018\u02bc`]/g;

  function prepare(s) {
    return s.normalize("NFKC").replace(APOSTROPHES, "'").toLowerCase();
  }

  /** normalize_text: lowercase, punctuation split into tokens -> list of tokens. */
  function tokenize(s) {
    const out = [];
    for (const m of prepare(s).matchAll(TOKEN_RE)) out.push(m[0]);
    return out;
  }

  function isSpace(ch) {
    return /\s/u.test(ch);
  }

  /** Typed text -> [completed tokens, normalized partial word] (suggest.split_text). */
  function splitText(text) {
    if (text.length > MAX_TEXT_TAIL) {
      const cps = Array.from(text);
      if (cps.length > MAX_TEXT_TAIL) {
        const tail = cps.slice(cps.length - MAX_TEXT_TAIL);
        const cut = tail.findIndex(isSpace);
        text = cut >= 0 ? tail.slice(cut + 1).join("") : "";
      }
    }
    const s = prepare(text);
    if (!s || isSpace(s[s.length - 1])) return [tokenize(s), ""];
    const m = PARTIAL_RE.exec(s);
    if (!m) return [tokenize(s), ""];
    return [tokenize(s.slice(0, m.index)), m[0]];
  }

  function isTerminator(tok) {
    if (!tok) return false;
    for (const ch of tok) if (ch !== "." && ch !== "!" && ch !== "?") return false;
    return true;
  }

  /** The current sentence's words, windowed (suggest.context_words). */
  function contextWords(tokens, maxContext = MAX_CONTEXT) {
    let start = 0;
    for (let i = tokens.length - 1; i >= 0; i--) {
      if (isTerminator(tokens[i])) {
        start = i + 1;
        break;
      }
    }
    let words = tokens.slice(start);
    if (words.length > maxContext) {
      const hop = Math.max(1, Math.floor(maxContext / 2));
      const k = Math.ceil((words.length - maxContext) / hop);
      words = words.slice(k * hop);
    }
    return words;
  }

  function suggestible(word) {
    return ALNUM_RE.test(word);
  }

  /** Top-k of (score desc, id asc) over `ids` (or all ids with mask when ids is null). */
  function topK(logprobs, ids, mask, k) {
    const best = []; // [score, id], sorted best first
    const consider = (id) => {
      const sc = logprobs[id];
      if (best.length === k) {
        const last = best[k - 1];
        if (sc < last[0] || (sc === last[0] && id > last[1])) return;
      }
      let j = best.length;
      while (j > 0 && (best[j - 1][0] < sc || (best[j - 1][0] === sc && best[j - 1][1] > id))) j--;
      best.splice(j, 0, [sc, id]);
      if (best.length > k) best.pop();
    };
    if (ids) for (let i = 0; i < ids.length; i++) consider(ids[i]);
    else for (let id = 0; id < logprobs.length; id++) if (mask[id]) consider(id);
    return best.map((b) => b[1]);
  }

  class Suggester {
    /** `ort`: the onnxruntime-web namespace; `session`: an ort.InferenceSession; `meta`: model.json */
    constructor(ort, session, meta, maxContext = MAX_CONTEXT) {
      const tok = meta.tokenizer || {};
      if (tok.kind !== "word") {
        throw new Error(
          `this model uses a ${tok.kind || "unknown"} tokenizer; word suggestions need a ` +
            "word-vocabulary model (export one trained with --tokenizer word)",
        );
      }
      this.ort = ort;
      this.session = session;
      this.meta = meta;
      this.round = meta.round;
      this.maxContext = maxContext;
      this.words = tok.words;
      this.vocabSize = meta.model.vocab_size;
      this.numLayers = meta.model.num_layers || 1;
      this.hidden = meta.model.hidden_size;
      this.lstm = session.inputNames.includes("c0");
      this.stateIn = this.lstm ? ["h0", "c0"] : ["h0"];
      this.stateOut = this.lstm ? ["hn", "cn"] : ["hn"];
      this.stoi = new Map();
      this.words.forEach((w, i) => this.stoi.set(w, i));
      this.mask = new Uint8Array(this.words.length);
      const sortable = [];
      this.words.forEach((w, i) => {
        if (i >= 3 && suggestible(w)) {
          this.mask[i] = 1;
          sortable.push([w, i]);
        }
      });
      // Code-point order, as Python sorts strings.
      const cmp = (a, b) => (a < b ? -1 : a > b ? 1 : 0);
      sortable.sort((a, b) => cmpCodePoints(a[0], b[0]) || cmp(a[1], b[1]));
      this.sortedWords = sortable.map((x) => x[0]);
      this.sortedIds = Int32Array.from(sortable.map((x) => x[1]));
      this.calls = 0;
      this.initial = null;
    }

    async init() {
      this.initial = await this._initialEntry();
      return this;
    }

    zeroState() {
      const n = this.numLayers * this.hidden;
      return this.stateIn.map(
        () => new this.ort.Tensor("float32", new Float32Array(n), [this.numLayers, 1, this.hidden]),
      );
    }

    /** Feed `ids` after `state` in one call -> [logprobs per position, state after]. */
    async run(ids, state) {
      this.calls += 1;
      const feeds = {
        tokens: new this.ort.Tensor("int64", BigInt64Array.from(ids, (x) => BigInt(x)), [
          1,
          ids.length,
        ]),
      };
      this.stateIn.forEach((name, i) => (feeds[name] = state[i]));
      const out = await this.session.run(feeds);
      const lp = out.logprobs.data;
      const V = this.vocabSize;
      const rows = [];
      for (let t = 0; t < ids.length; t++) rows.push(lp.subarray(t * V, (t + 1) * V));
      return [rows, this.stateOut.map((name) => out[name])];
    }

    async _initialEntry() {
      const [rows, state] = await this.run([1], this.zeroState());
      return { token: 1, state, logprobs: rows[0] };
    }

    encode(words) {
      return words.map((w) => (this.stoi.has(w) ? this.stoi.get(w) : 0));
    }

    contextIds(text) {
      const [tokens, partial] = splitText(text);
      return [this.encode(contextWords(tokens, this.maxContext)), partial];
    }

    rank(logprobs, partial, k = SLOTS) {
      let ids = null;
      if (partial) {
        const lo = lowerBound(this.sortedWords, partial);
        const hi = lowerBound(this.sortedWords, partial + "\u{10ffff}", lo);
        if (hi <= lo) return [];
        ids = this.sortedIds.subarray(lo, hi);
      }
      return topK(logprobs, ids, this.mask, k).map((id) => this.words[id]);
    }

    newSession() {
      return new Session(this);
    }
  }

  function cmpCodePoints(a, b) {
    // JS compares UTF-16 units; Python compares code points. They differ only for astral
    // characters against U+E000..U+FFFF, so compare code point by code point.
    const ia = a[Symbol.iterator]();
    const ib = b[Symbol.iterator]();
    for (;;) {
      const x = ia.next();
      const y = ib.next();
      if (x.done || y.done) return x.done === y.done ? 0 : x.done ? -1 : 1;
      const cx = x.value.codePointAt(0);
      const cy = y.value.codePointAt(0);
      if (cx !== cy) return cx < cy ? -1 : 1;
    }
  }

  function lowerBound(arr, key, lo = 0) {
    let hi = arr.length;
    while (lo < hi) {
      const mid = (lo + hi) >>> 1;
      if (cmpCodePoints(arr[mid], key) < 0) lo = mid + 1;
      else hi = mid;
    }
    return lo;
  }

  class Session {
    constructor(suggester) {
      this.suggester = suggester;
      this.stack = [];
      this.steps = 0;
    }

    top() {
      return this.stack.length ? this.stack[this.stack.length - 1] : this.suggester.initial;
    }

    async advance(ids) {
      // Keep the longest common prefix; one model step (one token) per word after it.
      const stack = this.stack;
      let k = 0;
      const n = Math.min(stack.length, ids.length);
      while (k < n && stack[k].token === ids[k]) k++;
      stack.length = k;
      let top = this.top();
      for (const tok of ids.slice(k)) {
        const [rows, state] = await this.suggester.run([tok], top.state);
        this.steps += 1;
        top = { token: tok, state, logprobs: rows[0] };
        stack.push(top);
      }
      return top.logprobs;
    }

    async suggest(text) {
      const s = this.suggester;
      const [ids, partial] = s.contextIds(text);
      const logprobs = await this.advance(ids);
      return { suggestions: s.rank(logprobs, partial), round: s.round };
    }
  }

  const api = { splitText, contextWords, tokenize, isTerminator, Suggester, Session, MAX_CONTEXT };
  if (typeof module !== "undefined" && module.exports) module.exports = api;
  else root.FedkeySuggest = api;
})(typeof window !== "undefined" ? window : globalThis);
