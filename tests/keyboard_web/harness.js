/* Runs the page's modules (keyboard_web/static/*.js) under Node for test_kw_js.py: one JSON
 * command on stdin, one JSON answer on stdout; large float vectors are written as raw float64
 * files (the paths the command names) so Python compares them bit for bit.
 *
 *   node harness.js STATIC_DIR < command.json
 */
"use strict";

const fs = require("fs");
const path = require("path");

const dir = process.argv[2];
const S = require(path.join(dir, "suggest.js"));
const N = require(path.join(dir, "ngram.js"));
const P = require(path.join(dir, "personal.js"));

function writeFloats(file, arr) {
  fs.writeFileSync(file, Buffer.from(Float64Array.from(arr).buffer));
}

function readFloats(file) {
  const b = fs.readFileSync(file);
  return new Float64Array(b.buffer, b.byteOffset, b.byteLength / 8);
}

/** A stand-in for onnxruntime-web: the "model" gives the row `table[token]` after any state. */
function fakeModel(table, vocabSize) {
  class Tensor {
    constructor(type, data, dims) {
      Object.assign(this, { type, data, dims });
    }
  }
  const session = {
    inputNames: ["tokens", "h0"],
    run: async (feeds) => {
      const tokens = Array.from(feeds.tokens.data, Number);
      const data = new Float32Array(tokens.length * vocabSize);
      tokens.forEach((t, i) => data.set(table[t], i * vocabSize));
      return { logprobs: { data }, hn: feeds.h0 };
    },
  };
  return [{ Tensor }, session];
}

function meta(words, ngram) {
  return {
    round: 7,
    tokenizer: { kind: "word", words },
    model: { vocab_size: words.length, hidden_size: 2, num_layers: 1 },
    ...(ngram ? { ngram } : {}),
  };
}

function cacheOf(cmd) {
  const cache = new P.PersonalCache(cmd.max_words);
  for (const m of cmd.messages || []) cache.learn(m);
  return cache;
}

const commands = {
  /** Parse ngram.safetensors; the tensors' values and the distributions after `contexts`. */
  async ngram(cmd) {
    const bytes = fs.readFileSync(cmd.file);
    const parsed = N.parseSafetensors(bytes);
    const ngram = await N.loadNGram(new Uint8Array(bytes), cmd.words, cmd.sha256);
    cmd.contexts.forEach((ctx, i) => writeFloats(`${cmd.out}.${i}`, ngram.distribution(ctx)));
    const tensors = {};
    for (const [name, arr] of Object.entries(parsed.tensors)) {
      writeFloats(`${cmd.out}.${name}`, arr);
      tensors[name] = parsed.shapes[name];
    }
    return { order: ngram.order, metadata: parsed.metadata, tensors };
  },

  /** loadNGram's refusal of a file that is not the one model.json names, or another vocabulary. */
  async ngramError(cmd) {
    try {
      await N.loadNGram(new Uint8Array(fs.readFileSync(cmd.file)), cmd.words, cmd.sha256);
      return { error: null };
    } catch (e) {
      return { error: String(e.message) };
    }
  },

  /** Type `text` into a Session over the fake model (with the n-gram when given): the log-probs
   * of every stack entry (<s> first), and the bar. */
  async session(cmd) {
    const table = cmd.table.map((f) => readFloats(f));
    const [ort, session] = fakeModel(table, cmd.words.length);
    let ngram = null;
    if (cmd.ngram) {
      ngram = await N.loadNGram(new Uint8Array(fs.readFileSync(cmd.ngram.path)), cmd.words);
    }
    const sugg = await new S.Suggester(ort, session, meta(cmd.words, cmd.ngram && cmd.ngram.meta), {
      ngram,
    }).init();
    const sess = sugg.newSession();
    const out = [];
    for (const text of cmd.texts) {
      const res = await sess.suggest(text);
      out.push({ suggestions: res.suggestions, tokens: sess.stack.map((e) => e.token) });
    }
    [sugg.initial, ...sess.stack].forEach((e, i) => writeFloats(`${cmd.out}.${i}`, e.logprobs));
    return { results: out, steps: sess.steps };
  },

  /** The bar for the log-probs in `logprobs` (a float64 file) and each partial word, with the
   * personal cache learned from `messages` when given. */
  async rank(cmd) {
    const [ort, session] = fakeModel([], cmd.words.length);
    const sugg = new S.Suggester(ort, session, meta(cmd.words));
    const logprobs = readFloats(cmd.logprobs);
    const personal = cmd.messages
      ? { cache: cacheOf(cmd), params: P.personalParams(cmd.params) }
      : null;
    const prev = cmd.prev || "<s>";
    return cmd.partials.map((partial) => sugg.rank(logprobs, partial, 3, personal, prev));
  },

  /** The personal cache after `messages`: its weight, p_cache for each [prev, word], what it
   * stores, and the cache read back from that. */
  async personal(cmd) {
    const cache = cacheOf(cmd);
    const params = P.personalParams(cmd.params);
    const stored = new Map();
    const storage = {
      getItem: (k) => (stored.has(k) ? stored.get(k) : null),
      setItem: (k, v) => stored.set(k, v),
      removeItem: (k) => stored.delete(k),
    };
    cache.save(storage);
    const back = P.PersonalCache.load(storage, cmd.max_words);
    const p = ([prev, w]) => cache.scorer(prev, params)(w);
    return {
      params,
      defaults: P.DEFAULTS,
      storage_key: P.STORAGE_KEY,
      max_words: P.MAX_WORDS,
      size: cache.size,
      total: cache.total,
      weight: cache.weight(params),
      probs: (cmd.queries || []).map(p),
      words: Array.from(cache.words()),
      stored: JSON.parse(stored.get(P.STORAGE_KEY) || "null"),
      same_back: JSON.stringify(back) === JSON.stringify(cache),
      garbage: P.PersonalCache.load({ getItem: () => "{not json" }).size,
    };
  },
};

let input = "";
process.stdin.on("data", (d) => (input += d));
process.stdin.on("end", async () => {
  const cmd = JSON.parse(input);
  const answer = await commands[cmd.command](cmd);
  process.stdout.write(JSON.stringify(answer));
});
