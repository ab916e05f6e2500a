"""MEMORY_MODE_COMPRESSIVE served: Score and Generate with a Compressive Transformer memory
(Rae et al. 2019; mean pooling, no trained compressor), against the library in process.

Oracles: memlm.jobs.scoring.score_tokens_segments and memlm.jobs.segment_eval.evaluate_segments (what
`memlm eval --memory compressive` runs) for Score, the reference decoder for Generate; and an invariant: the
compressed memory changes the scores once states leave the memory (XL of the same memory length differs).
"""

from __future__ import annotations

import math

from reference_decoding import reference_generate
from memlm.jobs.decoding import SamplingConfig, TokenEvent
from memlm.jobs.scoring import score_tokens_segments
from memlm.jobs.segment_eval import evaluate_segments
from memlm.model.memory_config import MemoryConfig
from memlm.model.tokenizer import document_boundary
from services.lm.client import LanguageModelClient, MemoryRequest, TextDelta

SIZES = MemoryRequest(segment_tokens=8, memory_tokens=8, sink_tokens=2, compressed_memory_tokens=4, compression_rate=2)
CONFIG = MemoryConfig("compressive", mem_len=8, sink_tokens=2, segment=8, cmem_len=4, compress_rate=2)


def test_score_compressive_equals_the_library_and_memlm_eval(tiny, docs, servers):
    bos = document_boundary(tiny.tokenizer)
    with LanguageModelClient(servers["plain"], timeout=60) as c:
        remote = c.score(docs, memory_mode="compressive", memory=SIZES, top_n=2)
        xl = c.score(docs, memory_mode="xl", memory=MemoryRequest(segment_tokens=8, memory_tokens=8, sink_tokens=2))
        info = c.info()
    local = score_tokens_segments(tiny.model, docs, memory=CONFIG, boundary_token=bos, top_n=2)
    for r, s in zip(remote, local):
        assert [t.token_id for t in r.tokens] == s.tokens.tolist()
        # Score runs on the engine's compressive rows (services.lm.score_engine): float32 rounding only.
        assert all(math.isclose(g, w, rel_tol=1e-5, abs_tol=1e-6) for g, w in zip([t.base_logprob for t in r.tokens],
                                                                                  s.base_logprob.tolist()))
        assert [[a.token_id for a in t.alternatives] for t in r.tokens] == s.top_ids.tolist()
    # Same rows as the server (LMLimits.score_batch_size 4), so the sums agree to rounding of the sum.
    result = evaluate_segments(tiny.model, docs, segment=8, memory="compressive", mem_len=8, cmem_len=4,
                               compress_rate=2, sink_tokens=2, batch_size=4, boundary_token=bos)
    total = sum(r.total_logprob for r in remote)
    assert math.isclose(total, -result["nll"] * result["tokens"], rel_tol=1e-6)
    assert abs(total - sum(r.total_logprob for r in xl)) > 1e-3  # the compressed memory is attended
    d = info.default_memory
    assert (d.compressed_memory_tokens, d.compression_rate) == (256, 4)


def test_generate_compressive_equals_the_library(tiny, servers):
    tok = tiny.tokenizer
    prompt = tok.encode("The quick brown fox jumps over the lazy dog")  # past memory + one segment
    for sampling in (SamplingConfig(temperature=0.0), SamplingConfig(temperature=0.9, top_k=50, seed=5)):
        events = list(reference_generate(tiny.model, tok, prompt, max_new_tokens=20, sampling=sampling,
                                         boundary_token=document_boundary(tok), eos_id=tok.eos_id, memory=CONFIG))
        want = [(e.token_id, e.logprob) for e in events if isinstance(e, TokenEvent)]
        with LanguageModelClient(servers["plain"], timeout=60) as c:
            got = list(c.generate(prompt, max_new_tokens=20, temperature=sampling.temperature, top_k=sampling.top_k,
                                  seed=sampling.seed, memory_mode="compressive", memory=SIZES))
        pairs = [(d.token_ids[0], d.logprobs[0]) for d in got if isinstance(d, TextDelta) and d.token_ids]
        assert [t for t, _ in pairs] == [t for t, _ in want]  # served by the engine's compressive rows
        assert max(abs(a - b) for (_, a), (_, b) in zip(pairs, want)) < 1e-4  # float32 rounding of the cache path
        assert got[-1].completion_tokens == len(want)
