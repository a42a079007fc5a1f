"""The SGLang versions this adapter knows (checked by ``BaseInstrumentor`` and
``opentelemetry-instrument``; the patch groups check the code itself too)."""

_instruments = ("sglang >= 0.5.23, < 0.6",)

_supports_metrics = True
