/* The personal cache of the in-browser mode: the user's own words, kept on the device.
 *
 * A cache language model (Kuhn & De Mori 1990, "A cache-based natural language model for speech
 * recognition"), as fedkey.models.personal measures it:
 * - counts: c1[w] of the words the user sent, c2[prev][w] of each word after the previous token
 *   of its sentence ("<s>" at a sentence start, and again after a ". ! ?" token); n = sum of c1.
 *   Tokens are normalize_text's; only suggestible words (a letter or a digit) are counted as w,
 *   in the vocabulary or not (that is how the keyboard learns a user's names and slang).
 * - p_cache(w | prev) = (c2[prev][w] + beta * c1[w] / n) / (sum_w c2[prev][w] + beta);
 * - its weight mu = max_weight * n / (n + ramp), and the bar ranks
 *   p(w) = (1 - mu) * p_base(w) + mu * p_cache(w | prev) (fedkey.keyboard_web suggest.js).
 * Stored in localStorage under "fedkey.personal.v1", never sent anywhere, and bounded: at most
 * 5,000 distinct words; past them the least counted are dropped first (among equal counts, the
 * one used longest ago).
 * Works in a browser (window.FedkeyPersonal) and in Node (module.exports) for tests.
 */
(function (root) {
  "use strict";

  const S =
    typeof module !== "undefined" && module.exports ? require("./suggest.js") : root.FedkeySuggest;

  const STORAGE_KEY = "fedkey.personal.v1";
  const MAX_WORDS = 5000;
  // fedkey.models.personal.DEFAULTS; model.json's "personal" overrides them.
  const DEFAULTS = Object.freeze({ max_weight: 0.5, ramp: 50, beta: 2 });
  const BOS = "<s>";

  /** model.json's "personal" over the defaults (a field missing or not a number: its default). */
  function personalParams(fromModel) {
    const out = { ...DEFAULTS };
    for (const key of Object.keys(DEFAULTS)) {
      const v = fromModel && fromModel[key];
      if (typeof v === "number" && isFinite(v)) out[key] = v;
    }
    return out;
  }

  /** Add `by` to counts.get(key), moving the key to the end (the most recently used). */
  function bump(counts, key, by = 1) {
    const c = (counts.get(key) || 0) + by;
    counts.delete(key);
    counts.set(key, c);
  }

  class PersonalCache {
    constructor(maxWords = MAX_WORDS) {
      this.maxWords = maxWords;
      this.clear();
    }

    clear() {
      this.unigrams = new Map(); // word -> count, least recently used first
      this.bigrams = new Map(); // prev -> Map(word -> count)
      this.total = 0; // n = sum of the unigram counts
    }

    get size() {
      return this.unigrams.size;
    }

    has(word) {
      return this.unigrams.has(word);
    }

    words() {
      return this.unigrams.keys();
    }

    /** Count the words of a sent message (normalize_text's tokens, sentence by sentence). */
    learn(message) {
      this.learnTokens(S.tokenize(message));
    }

    learnTokens(tokens) {
      let prev = BOS;
      for (const tok of tokens) {
        if (S.isTerminator(tok)) {
          prev = BOS;
          continue;
        }
        if (S.suggestible(tok)) {
          bump(this.unigrams, tok);
          if (!this.bigrams.has(prev)) this.bigrams.set(prev, new Map());
          bump(this.bigrams.get(prev), tok);
          this.total += 1;
        }
        prev = tok;
      }
      this.prune();
    }

    /** Keep at most maxWords distinct words: the least counted go first (ties: the one used
     * longest ago), with their bigrams. */
    prune() {
      const over = this.unigrams.size - this.maxWords;
      if (over <= 0) return;
      const byCount = Array.from(this.unigrams).sort((a, b) => a[1] - b[1]); // stable
      const dropped = new Set(byCount.slice(0, over).map(([w]) => w));
      for (const w of dropped) {
        this.total -= this.unigrams.get(w);
        this.unigrams.delete(w);
        this.bigrams.delete(w);
      }
      for (const [prev, row] of this.bigrams) {
        for (const w of dropped) row.delete(w);
        if (!row.size) this.bigrams.delete(prev);
      }
    }

    /** The cache's weight mu = max_weight * n / (n + ramp) (0 when empty). */
    weight(params) {
      const n = this.total;
      return n > 0 ? (params.max_weight * n) / (n + params.ramp) : 0;
    }

    /** w -> p_cache(w | prev), for the words of the cache. */
    scorer(prev, params) {
      const row = this.bigrams.get(prev) || new Map();
      let rowTotal = 0;
      for (const c of row.values()) rowTotal += c;
      const n = this.total;
      const beta = params.beta;
      const c1 = this.unigrams;
      return (w) => ((row.get(w) || 0) + (beta * (c1.get(w) || 0)) / n) / (rowTotal + beta);
    }

    toJSON() {
      return {
        version: 1,
        words: Array.from(this.unigrams),
        bigrams: Array.from(this.bigrams, ([prev, row]) => [prev, Array.from(row)]),
      };
    }

    /** From toJSON's object; anything malformed gives an empty cache. */
    static fromJSON(obj, maxWords = MAX_WORDS) {
      const cache = new PersonalCache(maxWords);
      if (!obj || obj.version !== 1 || !Array.isArray(obj.words)) return cache;
      const pair = (e) => Array.isArray(e) && e.length === 2 && typeof e[0] === "string";
      const counted = (e) => pair(e) && typeof e[1] === "number" && e[1] > 0 && isFinite(e[1]);
      for (const [w, c] of obj.words.filter(counted)) cache.unigrams.set(w, c);
      const rows = Array.isArray(obj.bigrams) ? obj.bigrams.filter(pair) : [];
      for (const [prev, row] of rows.filter((r) => Array.isArray(r[1]))) {
        const m = new Map(row.filter((e) => counted(e) && cache.has(e[0])));
        if (m.size) cache.bigrams.set(prev, m);
      }
      for (const c of cache.unigrams.values()) cache.total += c;
      cache.prune();
      return cache;
    }

    /** The cache kept in `storage` (localStorage) under STORAGE_KEY, or an empty one. */
    static load(storage, maxWords = MAX_WORDS) {
      let obj = null;
      try {
        obj = JSON.parse(storage.getItem(STORAGE_KEY) || "null");
      } catch {
        obj = null; // unreadable: start again
      }
      return PersonalCache.fromJSON(obj, maxWords);
    }

    save(storage) {
      if (this.size) storage.setItem(STORAGE_KEY, JSON.stringify(this));
      else storage.removeItem(STORAGE_KEY);
    }
  }

  const api = { PersonalCache, personalParams, DEFAULTS, MAX_WORDS, STORAGE_KEY };
  if (typeof module !== "undefined" && module.exports) module.exports = api;
  else root.FedkeyPersonal = api;
})(typeof window !== "undefined" ? window : globalThis);
