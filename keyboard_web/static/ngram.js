/* The export's n-gram (format "fedkey-kn-1", ngram.safetensors) for the in-browser mode, and its
 * mixture with the neural model.
 *
 * - parseSafetensors: the safetensors layout read by hand (8-byte little-endian header length, a
 *   JSON header naming each tensor's dtype, shape and data_offsets, then the raw little-endian
 *   data); int64 tensors are read through BigInt64Array and converted once to Numbers (the keys
 *   are below 2^53).
 * - NGram.distribution(context): interpolated Kneser-Ney's next-word distribution, computed from
 *   the file's tables exactly as fedkey.models.ngram.KneserNey.distribution computes it from its
 *   counts: the unigram, then for each level k = 2 .. order the context key of the last k - 1
 *   ids (base V, oldest first; the context padded in front with order - 2 <s>); a key found at
 *   index i scales p by gamma[i] and adds prob[off[i]:off[i+1]] to its words.
 * - mixLogProbs: linear interpolation (Mikolov et al. 2010, "Recurrent neural network based
 *   language model"; Gboard mixes an n-gram into its decoder the same way):
 *   p(w) = lam * p_nn(w) + (1 - lam) * p_kn(w), lam from model.json's "ngram"."weight".
 * Works in a browser (window.FedkeyNgram) and in Node (module.exports) for tests.
 */
(function (root) {
  "use strict";

  const FORMAT = "fedkey-kn-1";
  const BOS = 1; // <s>
  const ARRAYS = { F32: Float32Array, F64: Float64Array, I32: Int32Array, I64: BigInt64Array };
  const LITTLE_ENDIAN = new Uint8Array(new Uint16Array([1]).buffer)[0] === 1;

  /** The tensor `spec` ({dtype, shape, data_offsets}) of a file whose data starts at `base`. */
  function readTensor(bytes, base, name, spec) {
    const Type = ARRAYS[spec.dtype];
    if (!Type) throw new Error(`ngram.safetensors: ${name} has dtype ${spec.dtype}`);
    const [begin, end] = spec.data_offsets;
    const count = spec.shape.reduce((a, b) => a * b, 1);
    if (end - begin !== count * Type.BYTES_PER_ELEMENT || base + end > bytes.byteLength) {
      throw new Error(`ngram.safetensors: ${name}'s data does not match its shape`);
    }
    // A copy, so the typed array starts aligned whatever the header's length.
    const copy = new Uint8Array(bytes.subarray(base + begin, base + end)).buffer;
    const data = new Type(copy);
    return Type === BigInt64Array ? Float64Array.from(data, Number) : data;
  }

  /** safetensors bytes -> {tensors: {name: typed array}, shapes, metadata}. */
  function parseSafetensors(buffer) {
    if (!LITTLE_ENDIAN) throw new Error("this browser is big-endian; safetensors data is not");
    const bytes = buffer instanceof Uint8Array ? buffer : new Uint8Array(buffer);
    if (bytes.byteLength < 8) throw new Error("ngram.safetensors: shorter than its header");
    const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
    const headerLength = Number(view.getBigUint64(0, true));
    if (8 + headerLength > bytes.byteLength) throw new Error("ngram.safetensors: header cut short");
    const header = JSON.parse(new TextDecoder().decode(bytes.subarray(8, 8 + headerLength)));
    const tensors = {};
    const shapes = {};
    for (const [name, spec] of Object.entries(header)) {
      if (name === "__metadata__") continue;
      tensors[name] = readTensor(bytes, 8 + headerLength, name, spec);
      shapes[name] = spec.shape;
    }
    return { tensors, shapes, metadata: header.__metadata__ || {} };
  }

  /** Index of `key` in the ascending array `keys`, or -1. */
  function findKey(keys, key) {
    let lo = 0;
    let hi = keys.length;
    while (lo < hi) {
      const mid = (lo + hi) >>> 1;
      if (keys[mid] < key) lo = mid + 1;
      else hi = mid;
    }
    return lo < keys.length && keys[lo] === key ? lo : -1;
  }

  class NGram {
    /** From parseSafetensors' result; `vocabSize` is the model's (the file must agree). */
    constructor(parsed, vocabSize) {
      const meta = parsed.metadata;
      if (meta.format !== FORMAT) {
        throw new Error(`ngram.safetensors: format ${meta.format}, expected ${FORMAT}`);
      }
      this.order = Number(meta.order);
      this.vocabSize = Number(meta.vocab_size);
      this.vocabSha256 = meta.vocab_sha256;
      if (vocabSize !== undefined && this.vocabSize !== vocabSize) {
        throw new Error(`ngram.safetensors: ${this.vocabSize} words, the model has ${vocabSize}`);
      }
      const t = parsed.tensors;
      this.unigram = t.unigram;
      if (!this.unigram || this.unigram.length !== this.vocabSize) {
        throw new Error("ngram.safetensors: the unigram does not cover the vocabulary");
      }
      this.levels = []; // levels[k - 2] for k = 2 .. order
      for (let k = 2; k <= this.order; k++) {
        const level = {
          ctx: t[`ctx${k}`],
          off: t[`off${k}`],
          gamma: t[`gamma${k}`],
          word: t[`word${k}`],
          prob: t[`prob${k}`],
        };
        for (const [name, arr] of Object.entries(level)) {
          if (!arr) throw new Error(`ngram.safetensors: ${name}${k} is missing`);
        }
        this.levels.push(level);
      }
    }

    /** The key of the last `n` ids of the padded context (base V, oldest first), or -1. */
    contextKey(padded, n) {
      if (padded.length < n) return -1;
      let key = 0;
      const V = this.vocabSize;
      for (let j = padded.length - n; j < padded.length; j++) key = key * V + padded[j];
      return key;
    }

    /** P(next word | `context`), a Float64Array over the vocabulary. `context`: the token ids
     * of the sentence so far, starting with <s> (as the suggestion stack holds them). */
    distribution(context) {
      const padded = new Array(Math.max(0, this.order - 2)).fill(BOS).concat(context);
      const p = Float64Array.from(this.unigram);
      this.levels.forEach((lv, i) => {
        const at = findKey(lv.ctx, this.contextKey(padded, i + 1));
        if (at < 0) return; // an unseen context leaves p as it is
        const g = lv.gamma[at];
        for (let w = 0; w < p.length; w++) p[w] *= g;
        for (let e = lv.off[at]; e < lv.off[at + 1]; e++) p[lv.word[e]] += lv.prob[e];
      });
      return p;
    }

    /** The model's next-word log-probs mixed with this n-gram's after `context`. */
    mix(modelLogprobs, context, weight) {
      return mixLogProbs(modelLogprobs, this.distribution(context), weight);
    }
  }

  /** log(lam * exp(nn) + (1 - lam) * p): the mixed next-word log-probabilities (Float64Array). */
  function mixLogProbs(nnLogprobs, ngramProbs, weight) {
    const out = new Float64Array(nnLogprobs.length);
    for (let w = 0; w < out.length; w++) {
      out[w] = Math.log(weight * Math.exp(nnLogprobs[w]) + (1 - weight) * ngramProbs[w]);
    }
    return out;
  }

  /** sha256 hex of `bytes` (a Uint8Array or ArrayBuffer), or null without WebCrypto (a page
   * served over plain http to another host is not a secure context). */
  async function sha256Hex(bytes) {
    const subtle = root.crypto && root.crypto.subtle;
    if (!subtle) return null;
    const digest = new Uint8Array(await subtle.digest("SHA-256", bytes));
    return Array.from(digest, (b) => b.toString(16).padStart(2, "0")).join("");
  }

  /** The vocabulary's fingerprint as the file's "vocab_sha256" holds it ("\n".join(words)). */
  function vocabSha256(words) {
    return sha256Hex(new TextEncoder().encode(words.join("\n")));
  }

  /** ngram.safetensors' bytes -> NGram for a model with vocabulary `words`; throws when the file
   * is not the one model.json's "ngram" names (sha256) or was built on another vocabulary. */
  async function loadNGram(bytes, words, expectedSha256) {
    const fileSha = await sha256Hex(bytes);
    if (fileSha !== null && expectedSha256 && fileSha !== expectedSha256) {
      throw new Error("ngram.safetensors is not the file model.json names (sha256 differs)");
    }
    const ngram = new NGram(parseSafetensors(bytes), words.length);
    const vocabSha = await vocabSha256(words);
    if (vocabSha !== null && ngram.vocabSha256 && vocabSha !== ngram.vocabSha256) {
      throw new Error("ngram.safetensors was built on another vocabulary than the model's");
    }
    return ngram;
  }

  const api = { parseSafetensors, NGram, mixLogProbs, loadNGram, sha256Hex, FORMAT };
  if (typeof module !== "undefined" && module.exports) module.exports = api;
  else root.FedkeyNgram = api;
})(typeof window !== "undefined" ? window : globalThis);
