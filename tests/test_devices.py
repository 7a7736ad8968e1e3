"""Devices without a GPU: every tensor a code path creates is on the device it is used on.

A tensor created without ``device=`` lands on torch's default device, which is the CPU here but
need not be on a GPU machine (``torch.set_default_device("cuda")``), while a CPU ``Generator``
only draws on the CPU. Running a path with the meta device as the default makes each such
tensor fail (or read garbage) as it would there.
"""

import torch

from ktm.bench.measure import _words, word_pool
from ktm.evaluation.readability import r_interval
from ktm.tasks.tree import TreeTask
from ktm.training.config import TrainConfig
from ktm.training.train import train


def test_host_side_draws_ignore_torchs_default_device(ktm_model, tmp_path):
    """The data order, the bootstrap of R and the benchmark's words are drawn on the CPU with
    CPU generators; under another default device they failed ("Cannot copy out of meta
    tensor", on CUDA "Expected a 'cuda' device type for generator") or, for R's interval,
    indexed CPU numbers with another device's indices."""
    per_window = torch.tensor([[4.0, 3.0, 6.0, 2.0], [5.0, 3.5, 7.0, 2.0], [3.0, 2.0, 5.0, 1.0],
                               [6.0, 4.0, 8.0, 3.0], [4.5, 3.0, 6.5, 2.0]], dtype=torch.float64)
    expected = (r_interval(per_window), word_pool(ktm_model.tokenizer, size=8),
                _words(["a", "b", "c"], 5, seed=3))
    data = TreeTask(stage="small").train_examples(4, seed=0)
    cfg = TrainConfig(out_dir=str(tmp_path), max_steps=1, batch_size=2, save_every=0,
                      progress=False)
    with torch.device("meta"):
        got = (r_interval(per_window), word_pool(ktm_model.tokenizer, size=8),
               _words(["a", "b", "c"], 5, seed=3))
        last = train(ktm_model, data, cfg)
    assert expected[0] is not None and got == expected
    assert last["step"] == 1 and torch.isfinite(torch.tensor(last["loss"]))


def test_decoding_and_serving_create_nothing_off_the_model_device(tiny_model_dir):
    """A guard: the decode loop (seeded sampling, cached and uncached, spread positions) and
    the server's engine (stored KV, joined batches, logprobs) create every tensor on the
    model's device, so their outputs under another default device are the same."""
    from helpers import fresh_model

    from ktm.core.prompt import Segment
    from ktm.serving.config import ServeConfig
    from ktm.serving.engine import Engine, Job

    model = fresh_model(tiny_model_dir, spread_positions=True, slot_weights=True)
    prompts = ["The quick brown fox jumps over", [Segment("Hello world, my name is ktm."),
                                                  Segment(" Answer:", compress=False)]]
    ids = tuple(model.tokenize("The quick brown fox jumps over the lazy dog.", first=True))

    def run() -> tuple:
        texts = [model.generate(prompts, max_new_tokens=4, do_sample=True, seed=1, top_p=0.9,
                                use_cache=cache) for cache in (True, False)]
        engine, events = Engine(model, ServeConfig(model=tiny_model_dir, batch_window_ms=0)), []
        jobs = [Job((Segment("", ids=ids), Segment("", ids=ids[:2], compress=False)), 3,
                    events.append, temperature=t, seed=7, logprobs=1) for t in (0.0, 1.0)]
        with torch.no_grad():
            for job in jobs:  # the second one starts from the first one's stored KV
                engine._admit([job])
                engine._step()
            while engine._rows:
                engine._step()
        return texts, [(e.text, e.finish, e.error) for e in events]

    expected = run()
    with torch.device("meta"):
        assert run() == expected
