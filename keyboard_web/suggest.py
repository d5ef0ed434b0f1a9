"""Next-word suggestions from an exported keyboard model (onnxruntime + numpy + stdlib only).

The serving side of the keyboard. It never imports torch: the model is the ONNX export
(`export/onnx_export.py`), its vocabulary and shape come from the `<stem>.json` beside it.

The suggestion bar (fedkey.models.bar, the rule fedkey.models.metrics.keystroke_savings_of
scores): a slot is worth P(w) * (len(w) - typed), the keystrokes tapping w saves on average.
After a space (nothing typed of the next word) the bar shows the three best next words; while a
word is being typed, the three best vocabulary words that start with the typed prefix and are
longer than it (a word typed in full saves nothing and never takes a slot). The special tokens
(<unk>, <s>, </s>) and punctuation-only tokens are never suggested.

P(w) is the model's, mixed with the export's n-gram when it names one
(fedkey.keyboard_web.ngram: p = weight * p_model + (1 - weight) * p_ngram).

Context. The typed text is normalized like the training text (`fedkey.corpora.loaders.
normalize_text`: lowercase, punctuation split into tokens) and split into the completed words and
the partial word being typed (the text does not end with whitespace). The model sees the words of
the current sentence only: the context restarts with <s> after a ". ! ?" token, as every training
sentence starts with <s>. A sentence longer than `max_context` words is read from a window that
moves by `max_context // 2` words at a time, so the context holds between half and all of
`max_context` words and is a function of the text alone (the same whatever the editing history).

Cost. A `Session` (one per connection) keeps a stack of recurrent states and next-word
log-probabilities, one per word of the context. A keystroke that completes a word costs ONE model
step (one `session.run` of one token, from the state on top of the stack); an edit (backspace, a
paste) keeps the longest common prefix of the old and new contexts and steps only through the
words after it. Keystrokes inside a word cost no model call at all: completions are ranked with
the log-probabilities already on the stack (mixed with the n-gram's when it is pushed), found
through a sorted index of the vocabulary.
"""

from __future__ import annotations

import bisect
import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

from fedkey.common.text import fold, is_terminator, is_word, normalize_text
from fedkey.keyboard_web.ngram import ServedNgram
from fedkey.models.bar import savings_scores, word_lengths

__all__ = [
    "DEFAULT_MAX_CONTEXT",
    "MAX_TEXT_TAIL",
    "Session",
    "SuggestError",
    "Suggester",
    "is_terminator",
    "split_text",
]

DEFAULT_MAX_CONTEXT = 40  # words of the current sentence the model sees at most
MAX_TEXT_TAIL = 1000  # characters of the typed text that are read (the context lives at its end)
SLOTS = 3

# The word being typed: letters/digits, possibly joined by ' - . to more (as in normalize_text),
# and possibly ending with a ' or - that the next keystroke continues ("don'", "well-"). A
# trailing "." is not part of it: "hello." ends a sentence.
_PARTIAL_RE = re.compile(r"\w+(?:['\-.]\w+)*['\-]?$")


class SuggestError(ValueError):
    """The model cannot give suggestions (e.g. a SentencePiece model); the message says why."""


def split_text(text: str) -> tuple[list[str], str]:
    """Typed text -> (completed tokens, normalized partial word).

    Only the last `MAX_TEXT_TAIL` characters are read (cut at a whitespace so no word is split).
    The partial word is "" when the text ends with whitespace or punctuation.
    """
    if len(text) > MAX_TEXT_TAIL:
        tail = text[-MAX_TEXT_TAIL:]
        cut = re.search(r"\s", tail)
        text = tail[cut.end() :] if cut else ""
    s = fold(text)
    if not s or s[-1].isspace():
        return normalize_text(s).split(), ""
    m = _PARTIAL_RE.search(s)
    if m is None:
        return normalize_text(s).split(), ""
    return normalize_text(s[: m.start()]).split(), m.group(0)


def context_words(tokens: list[str], max_context: int = DEFAULT_MAX_CONTEXT) -> list[str]:
    """The words the model conditions on: the current sentence, windowed to `max_context`."""
    start = 0
    for i in range(len(tokens) - 1, -1, -1):
        if is_terminator(tokens[i]):
            start = i + 1
            break
    words = tokens[start:]
    if len(words) > max_context:
        hop = max(1, max_context // 2)
        k = -(-(len(words) - max_context) // hop)  # ceil: windows moved so far
        words = words[k * hop :]
    return words


def _read_metadata(onnx_path: Path) -> tuple[dict, bytes]:
    """The export's metadata and the exact JSON bytes it came from (b"" when embedded)."""
    side = onnx_path.with_suffix(".json")
    if side.exists():
        raw = side.read_bytes()
        return json.loads(raw), raw
    from fedkey.export.metadata import load_metadata  # stdlib + onnx: never torch

    meta = load_metadata(onnx_path)
    return meta, json.dumps(meta).encode()


@dataclass
class _Entry:
    """One position of a session's context: the token fed, the recurrent state after it and the
    log-probabilities of the next word (the model's mixed with the n-gram's)."""

    token: int
    state: tuple[np.ndarray, ...]
    logprobs: np.ndarray


def _rank_key(item: tuple[float, int]) -> tuple[float, int]:
    return (-item[0], item[1])


class Suggester:
    """An exported model ready to suggest: the ONNX session, the vocabulary and its indexes.

    Immutable once built, so one instance is shared by every connection; a hot reload builds a
    new one and swaps the reference.
    """

    def __init__(
        self,
        onnx_path: str | Path,
        max_context: int = DEFAULT_MAX_CONTEXT,
        threads: int = 1,
    ):
        self.path = Path(onnx_path)
        self.metadata, self.metadata_bytes = _read_metadata(self.path)
        # The bytes are kept so the exact model this instance serves can be sent to a browser,
        # even after a newer export has replaced the file.
        self.onnx_bytes = self.path.read_bytes()
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        self.session = ort.InferenceSession(
            self.onnx_bytes, sess_options=opts, providers=["CPUExecutionProvider"]
        )
        self.max_context = max_context
        self.calls = 0  # session.run calls (tests count them)

        model = self.metadata["model"]
        self.vocab_size = int(model["vocab_size"])
        self.num_layers = int(model.get("num_layers", 1))
        self.hidden_size = int(model["hidden_size"])
        names = {i.name for i in self.session.get_inputs()}
        self.state_inputs = ["h0", "c0"] if "c0" in names else ["h0"]
        self.state_outputs = ["hn", "cn"] if "c0" in names else ["hn"]
        self.outputs = ["logprobs", *self.state_outputs]

        tok = self.metadata.get("tokenizer") or {}
        self.tokenizer_kind = tok.get("kind")
        self.error: str | None = None
        if self.tokenizer_kind != "word":
            self.error = (
                f"this model uses a {self.tokenizer_kind or 'unknown'} tokenizer; word suggestions "
                "need a word-vocabulary model (export one trained with --tokenizer word)"
            )
            self.words: list[str] = []
        else:
            self.words = list(tok["words"])
            if len(self.words) != self.vocab_size:
                raise ValueError(
                    f"{self.path}: the vocabulary has {len(self.words)} words but the model "
                    f"{self.vocab_size} outputs"
                )
        self.stoi = {w: i for i, w in enumerate(self.words)}
        self.unk_id, self.bos_id, self.eos_id = 0, 1, 2
        suggestible = np.array([is_word(w) for w in self.words], dtype=bool)
        suggestible[: min(3, len(suggestible))] = False  # <unk> <s> </s>
        # Next words: an additive mask (0 or -inf) keeps the top-k a single argpartition.
        self.next_mask = np.where(suggestible, 0.0, -np.inf).astype(np.float32)
        # Completions: suggestible words sorted, so a prefix is a contiguous range (bisect).
        order = sorted((w, i) for i, w in enumerate(self.words) if suggestible[i])
        self.sorted_words = [w for w, _ in order]
        self.sorted_ids = np.array([i for _, i in order], dtype=np.int64)
        self.lengths = word_lengths(self.words)  # for the bar's keystrokes saved
        # The n-gram the export names (never raises: a broken one is reported, not used).
        self.ngram = ServedNgram.load(self.path, self.metadata, self.words)
        self.initial = self._initial_entry() if self.error is None else None

    # -- metadata ------------------------------------------------------------------------------

    @property
    def round(self) -> int | None:
        return self.metadata.get("round")

    @property
    def strategy(self) -> str | None:
        return self.metadata.get("strategy")

    @property
    def data(self) -> str | None:
        """The corpus the model learned from (demo, nus-sms, ubuntu-irc, a folder or file), as
        the export records it; None for an export made before it was recorded."""
        value = self.metadata.get("data")
        return value if isinstance(value, str) else None

    @property
    def best_round(self) -> int | None:
        """The round best on validation as of the served one (the served round itself when it
        is the best so far), as the export records it; None when not recorded."""
        value = self.metadata.get("best_round")
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    @property
    def metrics(self) -> dict:
        return self.metadata.get("metrics") or {}

    @property
    def privacy(self) -> dict:
        """The export's privacy facts (fedkey.export.metadata.privacy_facts): epsilon so far, delta, the
        budget, the noise multiplier, the bounding; an export made before they were recorded
        answers with every fact None ("dp": None: not recorded), never with a guess."""
        from fedkey.export.metadata import privacy_facts  # stdlib only

        facts = self.metadata.get("privacy")
        return dict(facts) if isinstance(facts, dict) else privacy_facts({})

    @property
    def perplexity(self) -> float | None:
        m = self.metrics
        for key in ("test_ppl", "val_ppl", "ppl"):
            if m.get(key) is not None:
                return float(m[key])
        return None

    @property
    def personal(self) -> dict:
        """The personal cache's parameters the export records (fedkey.models.personal.DEFAULTS
        for what it does not record, as the page does): the cache itself lives in the browser."""
        from fedkey.models.personal import DEFAULTS  # numpy + stdlib

        given = self.metadata.get("personal")
        given = given if isinstance(given, dict) else {}
        return {k: given.get(k, v) for k, v in DEFAULTS.items()}

    def info(self) -> dict:
        m = self.metrics
        model = self.metadata["model"]
        return {
            "round": self.round,
            "strategy": self.strategy,
            "data": self.data,
            "best_round": self.best_round,
            "perplexity": self.perplexity,
            "val_ppl": m.get("val_ppl"),
            "test_ppl": m.get("test_ppl"),
            "privacy": self.privacy,
            "int8": bool(self.metadata.get("int8", False)),
            "cell": model.get("cell"),
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_layers": self.num_layers,
            "tokenizer": self.tokenizer_kind,
            "suggestions": self.error is None,
            "error": self.error,
            "ngram": self.ngram.info(),
            "personal": self.personal,
        }

    # -- the model -----------------------------------------------------------------------------

    def zero_state(self) -> tuple[np.ndarray, ...]:
        h = np.zeros((self.num_layers, 1, self.hidden_size), dtype=np.float32)
        return tuple(h.copy() for _ in self.state_inputs)

    def run(
        self, tokens: list[int], state: tuple[np.ndarray, ...]
    ) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
        """Feed `tokens` after `state` in one call -> (logprobs [time, vocab], state after)."""
        self.calls += 1
        feed = {"tokens": np.asarray([tokens], dtype=np.int64)}
        feed.update(zip(self.state_inputs, state, strict=True))
        out = self.session.run(self.outputs, feed)
        return out[0][0], tuple(out[1:])

    def next_logprobs(self, model_logprobs: np.ndarray, context: list[int]) -> np.ndarray:
        """The next word's log-probabilities the bar ranks, after the context ids `context`
        (without <s>): the model's `model_logprobs`, mixed with the n-gram's."""
        return self.ngram.mix(model_logprobs, [self.bos_id, *context])

    def _initial_entry(self) -> _Entry:
        logprobs, state = self.run([self.bos_id], self.zero_state())
        return _Entry(self.bos_id, state, self.next_logprobs(logprobs[0], []))

    def start(self) -> _Entry:
        """The entry after <s>, where every suggestion starts (a model that cannot suggest,
        see `error`, has none)."""
        if self.initial is None:
            raise SuggestError(str(self.error))
        return self.initial

    def encode(self, words: list[str]) -> list[int]:
        get, unk = self.stoi.get, self.unk_id
        return [get(w, unk) for w in words]

    def context_ids(self, text: str) -> tuple[list[int], str]:
        """Typed text -> (ids of the context words, without <s>; the partial word)."""
        if self.error is not None:
            raise SuggestError(self.error)
        tokens, partial = split_text(text)
        return self.encode(context_words(tokens, self.max_context)), partial

    # -- ranking -------------------------------------------------------------------------------

    def rank(self, logprobs: np.ndarray, partial: str, k: int = SLOTS) -> list[str]:
        """The bar (fedkey.models.bar): the k suggestible words that save the most keystrokes on
        average, P(w) * (len(w) - len(partial)), among the next words (no partial) or the
        completions of `partial` longer than it."""
        if partial:
            lo = bisect.bisect_left(self.sorted_words, partial)
            hi = bisect.bisect_left(self.sorted_words, partial + "\U0010ffff", lo)
            if hi <= lo:
                return []
            ids = self.sorted_ids[lo:hi]
            scores = savings_scores(logprobs[ids], self.lengths[ids], len(partial))
        else:
            ids = None
            scores = savings_scores(logprobs, self.lengths, 0) + self.next_mask
        n = min(k, len(scores))
        if n <= 0:
            return []
        if len(scores) > n:
            kth = np.partition(scores, len(scores) - n)[len(scores) - n]  # the n-th best score
            cand = np.flatnonzero(scores >= kth)  # n of them, more when tied at the boundary
        else:
            cand = np.arange(len(scores))
        words = ids[cand] if ids is not None else cand
        # Best first; ties go to the lower id (the more frequent word).
        ranked = sorted(zip(scores[cand].tolist(), words.tolist(), strict=True), key=_rank_key)
        return [self.words[i] for sc, i in ranked[:n] if sc != -np.inf]

    def reply(self, suggestions: list[str]) -> dict:
        return {"suggestions": suggestions, "round": self.round}

    def suggest_fresh(self, text: str) -> dict:
        """From scratch, with no cache: the reference a `Session` must agree with."""
        ids, partial = self.context_ids(text)
        logprobs = self.start().logprobs
        if ids:
            lp, _ = self.run(ids, self.start().state)
            logprobs = self.next_logprobs(lp[-1], ids)
        return self.reply(self.rank(logprobs, partial))

    def suggest(self, text: str) -> dict:
        """Stateless suggestions for `text` (a connection keeps a `Session` instead)."""
        return self.suggest_fresh(text)

    def new_session(self) -> Session:
        """The per-connection cache: `new_session().suggest(text)` as the text changes."""
        return Session(self)


class Session:
    """The per-connection cache: a stack of recurrent states, one per context word."""

    def __init__(self, suggester: Suggester):
        self.suggester = suggester
        self.stack: list[_Entry] = []  # context words after <s>; <s> is suggester.initial
        self.steps = 0  # session.run calls made for this session

    @property
    def round(self) -> int | None:
        return self.suggester.round

    def _top(self) -> _Entry:
        return self.stack[-1] if self.stack else self.suggester.start()

    def advance(self, ids: list[int]) -> np.ndarray:
        """Make the stack hold exactly `ids`; -> the log-probs of the word after them.

        The stack keeps its longest common prefix with `ids`; each word after it costs one model
        step (one `session.run` of one token), so typing costs at most one step per completed
        word and an edit recomputes only the words after the common prefix.
        """
        stack = self.stack
        k, n = 0, min(len(stack), len(ids))
        while k < n and stack[k].token == ids[k]:
            k += 1
        del stack[k:]
        top = self._top()
        for j in range(k, len(ids)):
            logprobs, state = self.suggester.run([ids[j]], top.state)
            self.steps += 1
            top = _Entry(ids[j], state, self.suggester.next_logprobs(logprobs[0], ids[: j + 1]))
            stack.append(top)
        return top.logprobs

    def suggest(self, text: str) -> dict:
        s = self.suggester
        ids, partial = s.context_ids(text)
        return s.reply(s.rank(self.advance(ids), partial))
