"""The SGLang releases this adapter is tested on (checked by ``BaseInstrumentor`` and
``opentelemetry-instrument``; the patch groups check the code itself too): each release with
a lock in ``requirements/sglang/``, run by ``scripts/test-sglang.sh`` with the torch it pins.
Post-releases of the newest are in; the next release is not until it has a lock here."""

_instruments = ("sglang >= 0.5.20, < 0.5.24",)

_supports_metrics = True
