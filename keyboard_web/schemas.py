"""The keyboard's JSON answers as pydantic models, for /openapi.json: the routes answer plain
dicts (fedkey.keyboard_web.service), and these only describe them (`responses=`), so that nothing is
coerced or dropped on the way out."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class ErrorBody(BaseModel):
    detail: str = Field(description="What went wrong.")


class BrowserMode(BaseModel):
    available: bool = Field(description="Whether the page can run the model in the browser.")
    reason: str | None = Field(description="Why not (None when it can).")
    script: str | None = Field(
        None, description="The onnxruntime-web script the page loads (when available)."
    )


class EventsRelay(BaseModel):
    url: str | None = Field(description="The federation server relayed (None: none).")
    connected: bool = Field(description="Whether its WS /v1/events is connected now.")
    error: str | None = Field(description="The last connection error.")


class Info(BaseModel):
    """GET /api/info: the served model (fedkey.keyboard_web.suggest.Suggester.info), then browser mode,
    the events relay and the hot reloads."""

    model_config = ConfigDict(extra="allow")

    round: int | None = Field(description="The served model's round.")
    strategy: str | None
    data: str | None = Field(
        description="The corpus the served model learned from (demo, nus-sms, ubuntu-irc, a "
        "folder or file); None when the export does not record it."
    )
    best_round: int | None = Field(
        description="The round best on validation as of the served one (the served round when "
        "it is the best so far); None when the export does not record it."
    )
    perplexity: float | None = Field(description="Test perplexity, else validation.")
    val_ppl: float | None
    test_ppl: float | None
    privacy: dict[str, Any] = Field(
        description="fedkey.export.metadata.privacy_facts of the export."
    )
    int8: bool = Field(description="Whether the weights are quantized to int8.")
    cell: str | None
    vocab_size: int
    hidden_size: int
    num_layers: int
    tokenizer: str | None
    suggestions: bool = Field(description="Whether the model can suggest words.")
    error: str | None = Field(description="Why it cannot (None when it can).")
    ngram: dict[str, Any] | None = Field(
        description="The n-gram mixed into the suggestions (fedkey.keyboard_web.ngram): active, "
        "order, weight (the model's share), weight_source, corpus, min_count, bytes, file, and "
        "why it is not used (error; the model then suggests alone); None when the export names "
        "none."
    )
    personal: dict[str, float] = Field(
        description="The personal cache's parameters (max_weight, ramp, beta) from the export, "
        "fedkey.models.personal.DEFAULTS where it records none; the cache lives in the browser."
    )
    browser_mode: BrowserMode
    events: EventsRelay
    reloads: int = Field(description="Hot reloads since start.")
    reload_error: str | None = Field(description="Why the last hot reload failed, if it did.")
    watch_dir: str | None = Field(description="The directory hot-reloaded from.")


class Metrics(BaseModel):
    """GET /api/metrics."""

    rounds: list[dict[str, Any]] = Field(
        description="The federation server's metrics rows, or the rounds served here "
        "(round, strategy, val_ppl, test_ppl)."
    )
    source: str = Field(description='"federation" or "served".')


MODEL_HEADERS = {
    "X-Fedkey-Round": {
        "description": "The served model's round.",
        "schema": {"type": "string"},
    }
}
