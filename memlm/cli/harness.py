"""memlm as an lm-evaluation-harness model: `--model memlm`.

    python -m memlm.cli.harness --model memlm \\
        --model_args pretrained=smollm2-135m,datastore=DIR,lmbda=0.25,knn_temperature=1,k=1024 \\
        --tasks TASK --include_path DIR_OF_YAML

(`python -m memlm.cli.harness` is lm-eval's own command line with the `memlm` model registered;
`import memlm.cli.harness` registers it for lm_eval.simple_evaluate too.)

The three requests run through the library's scoring and generation, with the conventions of `memlm eval`
(memlm.jobs.scoring, memlm.engine.generate): every sequence starts with the document-boundary token
(memlm.model.tokenizer.document_boundary, also the harness's prefix_token_id, so an empty context is that
token alone), long ones are scored in sliding windows (context/stride: the datastore's, else the model's
defaults, memlm.jobs.windows.WindowConfig.for_model), kNN-LM mixes p_kNN with weight lmbda.
- loglikelihood: (context, continuation) -> (sum of the continuation's log-probs, every token greedy);
- loglikelihood_rolling: a text -> the sum of all its tokens' log-probs;
- generate_until: (context, {until, max_gen_toks, temperature, do_sample}) -> the continuation, cut
  before the first `until` string.
Requests are scored `batch_size` windows per forward pass. A datastore is opened here (the command-line
layer may open datastores) and checked against the model (memlm.retrieval.compat.check_searcher).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model

from memlm.errors import MemlmError
from memlm.engine.generate import generate
from memlm.jobs.decoding import GenerationEnd, SamplingConfig, TokenEvent
from memlm.jobs.scoring import score_tokens, score_tokens_segments
from memlm.jobs.windows import WindowConfig
from memlm.model.memory_config import MemoryConfig
from memlm.model.device import resolve_device, resolve_dtype
from memlm.model.tokenizer import document_boundary
from memlm.model.weights import load_pretrained
from memlm.retrieval.compat import adopt, check_searcher, say_taken
from memlm.retrieval.knnlm import KNNLMConfig

DEFAULT_MAX_GEN_TOKS = 256
"""generate_until's max_gen_toks when a task leaves it unset (lm-eval's own default)."""


@register_model("memlm")
class MemlmLM(TemplateLM):
    """A memlm model (any `memlm eval --model`: presets, .gguf, HF or memlm checkpoint dirs, hf:SOURCE), with
    kNN-LM over `datastore` and/or a memory (`memory`: a memlm.model.memory_config kind, `segment` its length);
    `allow_pickle_weights=True` lets a transformers model load pickled *.bin weights (--allow-pickle-weights)."""

    def __init__(self, pretrained: str = "smollm2-135m", datastore: str | None = None, lmbda: float = 0.25,
                 knn_temperature: float = 1.0, k: int = 1024, memory: str = "none", segment: int | None = None,
                 context: int | None = None, stride: int | None = None, batch_size: int | str = 4,
                 device: str = "auto", dtype: str = "auto", key_module: str | None = None,
                 allow_pickle_weights: bool = False) -> None:
        super().__init__()
        self._device = resolve_device(device)
        self.pre = load_pretrained(str(pretrained), device=self._device, dtype=resolve_dtype(dtype, self._device),
                                   key_module=key_module,
                                   allow_pickle=allow_pickle_weights is True)  # lm-eval parses "True" to True
        self.boundary = document_boundary(self.pre.tokenizer)
        self.batch_size = int(batch_size)
        self.searcher, self.knn = None, None
        recorded = None
        if datastore is not None:
            from datastore.datastore import Datastore

            self.searcher = Datastore.open(Path(datastore))
            recorded = self.searcher.info()
            self.knn = KNNLMConfig(k=int(k), lmbda=float(lmbda), temperature=float(knn_temperature))
        if recorded is not None:
            taken: list[str] = []
            context = adopt("context", None if context is None else int(context), recorded.context, "the datastore", taken)
            stride = adopt("stride", None if stride is None else int(stride), recorded.stride, "the datastore", taken)
            say_taken(taken, "the datastore")
            check_searcher(recorded, model_fingerprint=self.pre.fingerprint,
                           tokenizer_fingerprint=self.pre.tokenizer.fingerprint, dim=self.pre.model.config.n_embd,
                           key_layer=self.pre.model.config.key_description, boundary_token=self.boundary)
        self.window = WindowConfig.for_model(self.pre.model.config.max_seq_len, context and int(context),
                                             stride and int(stride), self.batch_size)
        self.memory = None
        if memory != "none":
            defaults = MemoryConfig(kind=memory)
            self.memory = MemoryConfig(kind=memory, segment=int(segment) if segment else defaults.segment)

    # -- TemplateLM's tokenization ----------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        eos = self.pre.tokenizer.eos_id
        return self.boundary if eos is None else eos

    @property
    def prefix_token_id(self) -> int:
        return self.boundary  # an empty context is the boundary token alone, as memlm scores

    @property
    def max_length(self) -> int:
        return self.pre.model.config.max_seq_len

    @property
    def tokenizer_name(self) -> str:
        return self.pre.tokenizer.fingerprint

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        return self.pre.tokenizer.encode(string)

    def tok_decode(self, tokens: list[int], **kwargs: Any) -> str:
        return self.pre.tokenizer.decode(tokens)

    # -- requests ---------------------------------------------------------------------------------

    def _score(self, seqs: list[list[int]], contexts: list[list[int]] | None) -> list[Any]:
        if self.memory is not None:
            return score_tokens_segments(self.pre.model, seqs, memory=self.memory, boundary_token=self.boundary,
                                         contexts=contexts, searcher=self.searcher, knn=self.knn,
                                         batch_size=self.batch_size)
        return score_tokens(self.pre.model, seqs, context=self.window.context, stride=self.window.stride,
                            boundary_token=self.boundary, contexts=contexts, searcher=self.searcher, knn=self.knn,
                            batch_size=self.batch_size)

    def _loglikelihood_tokens(self, requests: list[Any], disable_tqdm: bool = False, **kwargs: Any) -> list[tuple]:
        # memlm prepends the boundary token itself: a context that is that token alone is no context
        contexts = [[] if list(ctx) == [self.boundary] else list(ctx) for _, ctx, _ in requests]
        scores = self._score([list(cont) for _, _, cont in requests], contexts)
        out = []
        for (key, _, _), s in zip(requests, scores):
            out.append((s.total_logprob, s.is_greedy))
            self.cache_hook.add_partial("loglikelihood", key, out[-1])
        return out

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        texts = [req.args[0] for req in requests]
        scores = self._score([self.tok_encode(t) for t in texts], None)
        out = [s.total_logprob for s in scores]
        for text, value in zip(texts, out):
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), value)
        return out

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        out = []
        for req in requests:
            context, kwargs = req.args
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            temperature = float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample", False) else 0.0
            events = generate(self.pre.model, self.pre.tokenizer, self.tok_encode(context),
                              max_new_tokens=int(kwargs.get("max_gen_toks", DEFAULT_MAX_GEN_TOKS)),
                              sampling=SamplingConfig(temperature=temperature, seed=kwargs.get("seed")),
                              stop_sequences=until, boundary_token=self.boundary, eos_id=self.pre.tokenizer.eos_id,
                              searcher=self.searcher, knn=self.knn, memory=self.memory)
            text = "".join(e.text_delta for e in events if isinstance(e, (TokenEvent, GenerationEnd)))
            for stop in until:  # the harness' rule: the text before the first stop string
                text = text.split(stop)[0]
            out.append(text)
            self.cache_hook.add_partial("generate_until", (context, kwargs), text)
        return out


def main() -> None:
    """lm-eval's command line, with `--model memlm` registered."""
    from lm_eval.__main__ import cli_evaluate

    try:
        cli_evaluate()
    except MemlmError as e:
        raise SystemExit(f"memlm: error: {e}") from None


if __name__ == "__main__":
    main()
