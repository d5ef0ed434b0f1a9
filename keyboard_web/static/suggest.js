/* The suggestion logic of keyboard_web/suggest.py, ported to JavaScript for the in-browser mode.
 *
 * Same normalization (fedkey.common.text.normalize_text), same split into completed words and
 * the partial word, same context (the current sentence, windowed to 40 words), same state stack
 * (a new word costs one model step, an edit recomputes from the longest common prefix; each
 * entry holds the next-word log-probabilities, mixed with the export's n-gram when model.json
 * names one: ngram.js), same bar (fedkey.models.bar: the three words that save the most
 * keystrokes, P(w) * (len(w) - typed), completions of the partial word longer than it, never a
 * special or punctuation-only token, ties to the lower vocabulary id).
 * In this mode only, the bar also mixes in the user's own words (personal.js), words outside the
 * vocabulary included.
 * Works in a browser (window.FedkeySuggest) and in Node (module.exports) for tests.
 */
(function (root) {
  "use strict";

  const MAX_CONTEXT = 40;
  const BOS = 1; // <s>
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

  /** A word's length in code points, as Python's len counts it. */
  function codePoints(word) {
    return Array.from(word).length;
  }

  /** log(P(w) * (len(w) - typed)), fedkey.models.bar.savings_scores for one word: -Infinity when
   * the word saves nothing (it is no longer than what is typed). */
  function savingsScore(logprob, length, typed) {
    const left = length - typed;
    return left > 0 ? logprob + Math.log(left) : -Infinity;
  }

  /** The k best of the offered (score, id, word): score descending, then the lower id (a word
   * outside the vocabulary has id Infinity), then code-point order; -Infinity never kept. */
  class TopK {
    constructor(k) {
      this.k = k;
      this.best = []; // [score, id, word], best first
    }

    /** Whether (score, id, word) ranks before the kept item `b`. */
    static before(score, id, word, b) {
      if (score !== b[0]) return score > b[0];
      if (id !== b[1]) return id < b[1];
      return cmpCodePoints(word, b[2]) < 0;
    }

    /** False when `score` cannot enter (a fast test before `offer`). */
    admits(score) {
      return score > -Infinity && (this.best.length < this.k || score >= this.best[this.k - 1][0]);
    }

    offer(score, id, word) {
      if (!(score > -Infinity)) return; // -Infinity or NaN: not a suggestion
      const best = this.best;
      if (best.length === this.k && !TopK.before(score, id, word, best[this.k - 1])) return;
      let j = best.length;
      while (j > 0 && TopK.before(score, id, word, best[j - 1])) j--;
      best.splice(j, 0, [score, id, word]);
      if (best.length > this.k) best.pop();
    }

    words() {
      return this.best.map((b) => b[2]);
    }
  }

  class Suggester {
    /** `ort`: the onnxruntime-web namespace; `session`: an ort.InferenceSession; `meta`:
     * model.json; `ngram`: the n-gram meta.ngram names (ngram.js NGram), mixed in with its
     * "weight"; null: the model alone (as the server when it cannot use the file). */
    constructor(ort, session, meta, { ngram = null, maxContext = MAX_CONTEXT } = {}) {
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
      this.ngram = meta.ngram && ngram ? ngram : null;
      this.ngramWeight = this.ngram ? Number(meta.ngram.weight) : 1;
      this.stoi = new Map();
      this.words.forEach((w, i) => this.stoi.set(w, i));
      this.lengths = Int32Array.from(this.words, codePoints);
      this.maxLength = this.lengths.reduce((a, b) => Math.max(a, b), 0);
      this.mask = new Uint8Array(this.words.length);
      const sortable = [];
      this.words.forEach((w, i) => {
        if (i >= 3 && suggestible(w)) {
          this.mask[i] = 1;
          sortable.push([w, i]);
        }
      });
      this.nextIds = Int32Array.from(sortable.map((x) => x[1])); // every word the bar may show
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
      const [rows, state] = await this.run([BOS], this.zeroState());
      return { token: BOS, state, logprobs: this.nextLogprobs(rows[0], [BOS]) };
    }

    /** The model's next-word log-probs after `context` (ids from <s>), mixed with the n-gram's
     * distribution when there is one. */
    nextLogprobs(modelRow, context) {
      return this.ngram ? this.ngram.mix(modelRow, context, this.ngramWeight) : modelRow;
    }

    encode(words) {
      return words.map((w) => (this.stoi.has(w) ? this.stoi.get(w) : 0));
    }

    /** Typed text -> [context ids (without <s>), partial word, the previous token ("<s>" at a
     * sentence start: the personal cache's bigram context)]. */
    contextIds(text) {
      const [tokens, partial] = splitText(text);
      const words = contextWords(tokens, this.maxContext);
      const prev = words.length ? words[words.length - 1] : "<s>";
      return [this.encode(words), partial, prev];
    }

    /** gain[len] = log(len - typed), -Infinity when len <= typed: savingsScore's second term for
     * every vocabulary word length (a table, so ranking the vocabulary takes no logarithm). */
    gains(typed) {
      const gain = new Float64Array(this.maxLength + 1);
      for (let len = 0; len <= this.maxLength; len++) gain[len] = savingsScore(0, len, typed);
      return gain;
    }

    /** The ids the bar may show: every suggestible word, or the completions of `partial`. */
    candidates(partial) {
      if (!partial) return this.nextIds;
      const lo = lowerBound(this.sortedWords, partial);
      const hi = lowerBound(this.sortedWords, partial + "\u{10ffff}", lo);
      return this.sortedIds.subarray(lo, Math.max(lo, hi));
    }

    /** The bar: the k words saving the most keystrokes (fedkey.models.bar), best first.
     * `personal` ({cache, params}, or null) mixes in the user's words after `prev`:
     * p(w) = (1 - mu) * P(w) + mu * p_cache(w | prev). */
    rank(logprobs, partial, k = SLOTS, personal = null, prev = "<s>") {
      const typed = codePoints(partial);
      const mu = personal ? personal.cache.weight(personal.params) : 0;
      const keep = Math.log1p(-mu); // 0 without the cache
      const cache = mu > 0 ? personal.cache : null;
      const ids = this.candidates(partial);
      const gain = this.gains(typed);
      const best = new TopK(k);
      for (let j = 0; j < ids.length; j++) {
        const id = ids[j];
        const score = logprobs[id] + keep + gain[this.lengths[id]];
        if (!best.admits(score) || (cache && cache.has(this.words[id]))) continue; // cache: below
        best.offer(score, id, this.words[id]);
      }
      if (mu > 0) this.offerPersonal(best, logprobs, partial, typed, personal, prev, mu);
      return best.words();
    }

    /** Offer the cache's words that complete `partial` at their mixed probability. */
    offerPersonal(best, logprobs, partial, typed, { cache, params }, prev, mu) {
      const pCache = cache.scorer(prev, params);
      for (const w of cache.words()) {
        if (!w.startsWith(partial)) continue;
        const id = this.stoi.get(w);
        if (id !== undefined && !this.mask[id]) continue; // a special token: never shown
        const base = id === undefined ? 0 : Math.exp(logprobs[id]);
        const p = (1 - mu) * base + mu * pCache(w);
        best.offer(savingsScore(Math.log(p), codePoints(w), typed), id ?? Infinity, w);
      }
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
      for (let j = k; j < ids.length; j++) {
        const [rows, state] = await this.suggester.run([ids[j]], top.state);
        this.steps += 1;
        const context = [BOS, ...ids.slice(0, j + 1)];
        top = { token: ids[j], state, logprobs: this.suggester.nextLogprobs(rows[0], context) };
        stack.push(top);
      }
      return top.logprobs;
    }

    /** The bar for `text`; `personal` ({cache, params}) mixes in the user's words. */
    async suggest(text, personal = null) {
      const s = this.suggester;
      const [ids, partial, prev] = s.contextIds(text);
      const logprobs = await this.advance(ids);
      return { suggestions: s.rank(logprobs, partial, SLOTS, personal, prev), round: s.round };
    }
  }

  const api = {
    splitText,
    contextWords,
    tokenize,
    isTerminator,
    suggestible,
    savingsScore,
    Suggester,
    Session,
    MAX_CONTEXT,
  };
  if (typeof module !== "undefined" && module.exports) module.exports = api;
  else root.FedkeySuggest = api;
})(typeof window !== "undefined" ? window : globalThis);
