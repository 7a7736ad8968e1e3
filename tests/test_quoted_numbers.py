"""Numbers the pages quote outside their generated blocks, against the result files they come
from: each quote is written out from its file as the page prints it (the same ratio, the same
rounding) and must stand in the page, its lines joined. A result file run again, or a page
edited, that no longer agree fail here; ``tests/test_results_tables.py`` checks the generated
blocks."""

import json
import math
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ORDINALS = ("first", "second", "third", "fourth", "fifth")


def page(name: str) -> str:
    return " ".join((REPO / name).read_text().split())


def rows(name: str) -> list[dict]:
    return json.loads((REPO / "results" / name).read_text())


class Bench:
    """A ``ktm bench`` result file of plain and K=4 readings, each compiled or not, over native
    or int8 weights (``results/bench/compiled_cpu_int8.json``)."""

    def __init__(self, name: str):
        self.rows = {("plain" if r["method"] == "uncompressed" else f"K={r['k']}",
                      r["compile"], r["weights"]): r for r in rows(name)}

    def tps(self, reading: str, compile: str = "on", weights: str = "int8") -> float:
        return self.rows[reading, compile, weights]["decode_tokens_per_s"]

    def ttft(self, reading: str, compile: str, weights: str) -> float:
        return self.rows[reading, compile, weights]["ttft_s"]

    def speedup(self, reading: str, compile: str = "on", weights: str = "int8") -> float:
        """Decode tokens/s against eager native weights', the same reading."""
        return self.tps(reading, compile, weights) / self.tps(reading, "off", "native")


def int8_speed() -> dict[str, list[str]]:
    one, two = Bench("bench/compiled_cpu_int8.json"), Bench("bench/compiled_cpu_int8_2threads.json")
    tokens = next(iter(one.rows.values()))["input_tokens"]
    compiled = (f"{one.tps('plain'):.1f} tokens/s plain, {one.speedup('plain'):.2f}× eager "
                f"fp32, and {one.tps('K=4'):.1f} at K=4, {one.speedup('K=4'):.2f}×")
    table = [f"| {reading} | {c} | {w} | {r['ttft_s']:.2f} | {r['decode_tokens_per_s']:.1f} | "
             + (f"**{one.speedup(reading, c, w):.2f}×** |" if (c, w) == ("on", "int8")
                else f"{one.speedup(reading, c, w):.2f}× |")
             for (reading, c, w), r in one.rows.items()]
    return {
        "README.md": [f"{one.speedup('plain'):.2f}× eager fp32's tokens/s plain and "
                      f"{one.speedup('K=4'):.2f}× at K=4, {tokens:,} tokens in"],
        "docs/guide.md": [
            f"the first token in {one.ttft('plain', 'off', 'int8'):.2f} s against native's "
            f"{one.ttft('plain', 'off', 'native'):.2f} plain",
            f"{one.tps('plain'):.1f} tokens/s compiled plain, {one.speedup('plain'):.2f}× eager "
            f"fp32, and {one.tps('K=4'):.1f} at K=4, {one.speedup('K=4'):.2f}× (eager int8: "
            f"{one.tps('plain', 'off'):.1f} and {one.tps('K=4', 'off'):.1f}); on both cores "
            f"{two.tps('plain'):.1f} and {two.tps('K=4'):.1f}, {two.speedup('plain'):.2f}× and "
            f"{two.speedup('K=4'):.2f}×"],
        "results/README.md": [
            f"{one.tps('plain', 'on', 'native'):.1f} tokens/s against eager's "
            f"{one.tps('plain', 'off', 'native'):.1f} plain and "
            f"{one.tps('K=4', 'on', 'native'):.1f} against {one.tps('K=4', 'off', 'native'):.1f} "
            "at K=4", compiled],
        "results/bench/README.md": table,
    }


def int8_cost() -> dict[str, list[str]]:
    loss = {r["weights"]: r for r in rows("bench/int8_accuracy.json")}
    plain, k4 = rows("bench/compiled_parity_int8.json")
    assert (plain["reading"], k4["reading"]) == ("plain", "K=4")
    return {"docs/guide.md": [
        f"the text's loss rises from {loss['native']['nll']:.3f} to "
        f"{loss['int8 per row']['nll']:.3f} nats a token, and the next-token argmax agrees at "
        f"{loss['int8 per row']['argmax_agreement']:.1%}".replace("%", " %")
        + " of positions; scales per group of 32 inputs, as llama.cpp's Q8_0 keeps, would agree "
        f"at {loss['fp32 rounded per 32 inputs']['argmax_agreement']:.1%}".replace("%", " %"),
        f"{plain['same_greedy_steps']} of {plain['steps']} steps pick fp32's token plain, the "
        f"first other pick at the {ORDINALS[plain['first_differing_step']]} step, where fp32's "
        f"best two logits were {plain['first_differing_margin']:.3f} apart, and "
        f"{k4['same_greedy_steps']} of {k4['steps']} at K=4 (the first at the "
        f"{ORDINALS[k4['first_differing_step']]}, {k4['first_differing_margin']:.3f} apart); "
        "logits differ by up to "
        f"{max(plain['max_abs_logit_diff'], k4['max_abs_logit_diff']):.2f}"]}


def chats() -> dict[str, list[str]]:
    recall = {name: next(r["R_recall"] for r in rows(f"history/{name}.json")
                         if r["reading"] == "ktm")
              for name in ("chat-reader", "chat-shipped-reader")}
    cache_on = [t for t in rows("history/ttft.json") if t["prefix_cache_mb"] > 0]
    ahead = rows("history/ttft-ahead.json")
    # the turns where a new block of history merges: fewer positions than the turn before
    grew = {b["turn"] for a, b in zip(ahead, ahead[1:]) if b["positions"] < a["positions"]}
    assert grew == {t["turn"] for a, t in zip(cache_on, cache_on[1:])
                    if t["positions"] < a["positions"]}
    fast = [t["ttft_s"] for t in ahead if t["turn"] in grew]
    slow = [t["ttft_s"] for t in cache_on if t["turn"] in grew]
    big = rows("history/ttft-0.5b-ahead.json")
    second = big[1]["ttft_s"]
    off = max(abs(t["ttft_s"] / second - 1) for t in big[1:])
    return {
        "docs/serving.md": [
            f"keeps recall R {recall['chat-reader']:.2f} of a chat's first turn read merged at "
            f"a third of its positions, where the reader it started from keeps "
            f"{recall['chat-shipped-reader']:.2f}",
            f"start in {min(fast):.2f}-{max(fast):.2f} s instead of {min(slow):.1f}-"
            f"{max(slow):.1f} s",
            f"every turn from the second on starts within {math.ceil(off * 100)} % of the "
            f"second's"],
        "results/README.md": [
            f"start in {min(fast):.2f}-{max(fast):.2f} s instead of {min(slow):.2f}-"
            f"{max(slow):.2f} s",
            f"every turn from 2 to {len(big)} starts within {math.ceil(off * 100)} % of turn 2's "
            f"{second:.2f} s ({min(t['ttft_s'] for t in big[1:]):.2f} to "
            f"{max(t['ttft_s'] for t in big[1:]):.2f} s)"]}


def serving() -> dict[str, list[str]]:
    iso = rows("serving/isolation.json")
    hostile = [r for r in iso if "good_failed" in r and "kind" in r]
    big, short = (next(r for r in iso if r.get("kind", "").startswith(f"2,048 messages x {n}"))
                  for n in ("600", "12"))
    fuzz = {r["keyed"]: r for r in rows("serving/fuzz.json")}
    assert all(r["responses_5xx"] == 0 for r in fuzz.values())
    assert {f["code"] for r in fuzz.values() for f in r["failures"]} <= {"ST202", "ST112"}
    return {"docs/serving.md": [
        f"each of {len(hostile)} hostile requests",
        f"{sum(r['good_failed'] + r['good_changed'] for r in hostile)} of {4 * len(hostile)} "
        "failed or changed",
        f"got its 400 in {big['seconds']:.2f} s, two normal clients meanwhile answered in "
        f"{big['normal_seconds_median']:.2f} s (median of {big['config']['repeats']}; "
        f"{big['quiet_seconds_median']:.2f} s alone)",
        f"messages in {short['seconds']:.2f} s, the two in {short['normal_seconds_median']:.2f} s "
        f"({short['quiet_seconds_median']:.2f} s alone)",
        f"{fuzz[True]['cases']:,} requests with a key and {fuzz[False]['cases']:,} without"]}


CLAIMS = {"int8_speed": int8_speed, "int8_cost": int8_cost, "chats": chats, "serving": serving}


@pytest.mark.parametrize("claim", list(CLAIMS))
def test_each_quoted_number_is_its_result_files(claim):
    for name, quotes in CLAIMS[claim]().items():
        text = " ".join(page(name).split())  # a quote may wrap across lines
        missing = [q for q in quotes if " ".join(q.split()) not in text]
        assert missing == [], f"{name} does not say, as its result files do: {missing}"
