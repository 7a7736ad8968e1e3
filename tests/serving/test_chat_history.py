"""A chat read within a budget of positions (``--history-budget``, ``ktm.chat_prompt``): under
the budget every unmarked message is plain; past it the oldest are merged, whole, as few as fit,
never the system messages or the newest user message; a longer chat merges a superset, and the
server serves the merged history's KV again on the next turn; past merging them all, the oldest
are read deeper, then left out, and the chat keeps being answered; only a chat whose newest
message does not fit alone is refused, with its numbers."""

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from helpers import TEXT, perturb
from test_serve import _wait_until, get, openai_client, post

import ktm
from ktm.core.encoder import deeper_level
from ktm.errors import KTMError
from ktm.model import KTMModel, RuntimeSpec
from ktm.serving.app import BackgroundServer, create_app
from ktm.serving.config import ServeConfig
from ktm.serving.history import HistoryReading, block_ends, drop_ends, plan_history
from ktm.serving.protocol import RequestError


def chat(turns: int) -> list[dict]:
    out = [{"role": "system", "content": "You answer in one word."}]
    for t in range(turns):
        out += [{"role": "user", "content": f"Part {t}: {TEXT}"},
                {"role": "assistant", "content": f"Noted {t}, {TEXT[:30]}"}]
    return out + [{"role": "user", "content": "Which part came first?"}]


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    torch.manual_seed(0)
    m = KTMModel.from_base(tiny_model_dir, k=4)
    perturb(m)
    return m


def positions(model, segs) -> int:
    return model.encode_prompts([segs], embed=False)[0].tokens_out


def merged_contents(segs) -> list[str]:
    """The merged messages' contents (the template's space before a content moves into it)."""
    return [s.text.strip() for s in segs if s.compress]


def test_under_the_budget_every_unmarked_message_is_plain(model):
    messages = chat(3)
    plain = ktm.chat_prompt(model, messages, merge=False)
    assert ktm.chat_prompt(model, messages, history_budget=positions(model, plain)) == plain
    assert not any(s.compress for s in plain)
    # without a budget every content is merged, as the server reads an unmarked chat
    assert all(s.compress for s in ktm.chat_prompt(model, messages) if "Part" in s.text)


def test_past_the_budget_the_oldest_merge_first_and_as_few_as_fit(model):
    messages = chat(6)
    full = positions(model, ktm.chat_prompt(model, messages, merge=False))
    contents = [m["content"] for m in messages[1:-1]]  # eligible: not system, not newest
    # the older messages hold 33 tokens (user) and 18 (assistant) in turn, and a block of them
    # closes once it holds half the budget: at full - 1 (445) 9 of them (237 tokens, of 222)
    # fit as one block; at 3/4 (334) one block of 7 (186 of 167); at 3/5 (267) blocks of 5
    # (135 of 133) then 6 more (153), a block fewer (5) not fitting
    assert full == 446 and [len(model.tokenize(" " + c)) for c in contents] == [33, 18] * 6
    for budget, blocks in ((full - 1, [9]), (full * 3 // 4, [7]), (full * 3 // 5, [5, 11])):
        segs = ktm.chat_prompt(model, messages, history_budget=budget)
        merged = merged_contents(segs)
        assert positions(model, segs) <= budget
        assert merged == contents[:len(merged)]  # the oldest, in order, whole
        # whole blocks, and a block fewer would not fit: as few as fit
        assert len(merged) == blocks[-1]
        fewer = ([0] + blocks)[-2]
        with_fewer = [s if s.text.strip() not in merged[fewer:] else s.__class__(
            s.text, False, s.ids) for s in segs]
        assert positions(model, tuple(with_fewer)) > budget
        assert messages[0]["content"] not in merged and messages[-1]["content"] not in merged


def test_a_longer_chat_merges_what_the_shorter_one_did(model):
    budget = 290  # chat(5) is 381 positions plain, chat(8) 288 with all it may merge merged
    before = []
    for turns in range(5, 9):
        merged = merged_contents(ktm.chat_prompt(model, chat(turns), history_budget=budget))
        assert merged[:len(before)] == before
        before = merged
    assert before  # the budget was passed: the check can fail


def test_marked_messages_keep_their_marks(model):
    messages = chat(5)
    messages[1] = {**messages[1], "ktm": {"merge": False}}  # the oldest: the client keeps it
    messages[-1] = {**messages[-1], "ktm": {"merge": True}}  # the newest: the client merges it
    budget = positions(model, ktm.chat_prompt(model, messages, merge=False)) * 3 // 4
    segs = ktm.chat_prompt(model, messages, history_budget=budget)
    merged = merged_contents(segs)
    assert messages[1]["content"] not in merged and messages[-1]["content"] in merged
    assert messages[2]["content"] in merged


def test_a_chat_whose_newest_message_alone_does_not_fit_is_refused_with_its_numbers(model):
    messages = chat(4)
    alone = [messages[0], messages[-1]]  # what is always read: the system message, the newest
    least = positions(model, ktm.chat_prompt(model, alone, merge=False))
    with pytest.raises(KTMError, match=rf"needs {least} positions with every one of its 8 older "
                                       r"message\(s\) left out, over its history budget of 10"):
        ktm.chat_prompt(model, messages, history_budget=10)
    assert positions(model, ktm.chat_prompt(model, messages, history_budget=least)) == least
    with pytest.raises(KTMError, match="bad chat message at 0.role"):
        ktm.chat_prompt(model, [{"role": "robot", "content": "hi"}])


def test_the_plan_reads_deeper_then_leaves_out_only_as_far_as_it_must():
    """``block_ends`` and ``plan_history`` on made-up sizes and costs: the template 5
    positions, a message ``plain`` positions plain, 4 merged, 1 read deeper; messages of 10
    tokens, so a budget up to 21 makes blocks of one message."""
    def cost(d: int, m: int, plain: int = 10) -> int:
        return 5 + d + 4 * (m - d) + plain * (6 - m)

    sizes = [10] * 6
    # a block closes once it holds half the budget; the last may be short
    assert block_ends(sizes, 40) == [2, 4, 6] and block_ends(sizes, 50) == [3, 6]
    assert block_ends([5, 30, 1, 1], 20) == [2, 4] and block_ends([3], 1) == [1]
    assert plan_history(cost, sizes, 65, 4, 16) == (0, 0)  # fits plain
    assert plan_history(cost, sizes, 50, 4, 16) == (0, 3)  # blocks of 3 here: 5 + 12 + 30
    assert plan_history(cost, sizes, 21, 4, 16) == (3, 6)  # all merged is 29; 3 deeper: 20
    # with the oldest read deeper, fewer need merging: 3 deeper, 2 merged, 1 plain is 21
    assert plan_history(lambda d, m: cost(d, m, plain=5), sizes, 21, 4, 16) == (3, 5)
    with pytest.raises(RequestError, match="needs 11 positions even with its 6 older message"
                                           r"\(s\) read at K=16"):
        plan_history(cost, sizes, 10, 4, 16)
    with pytest.raises(RequestError, match="merged at K=4"):
        plan_history(cost, sizes, 25, 4, None)  # no deeper level: merging is as far as it goes
    # leaving out never leaves an assistant message first
    assert drop_ends([10] * 6, 20, ["user", "assistant"] * 3) == [2, 4, 6]
    assert drop_ends([30, 1, 1, 30], 20, ["user", "assistant", "user", "assistant"]) == [2, 4]


def _history(model, messages, budget) -> tuple[tuple, HistoryReading]:
    from ktm.serving.prompts import chat_reading
    from ktm.serving.protocol import ChatRequest

    segs, press, how = chat_reading(model, ChatRequest(model="tiny", messages=messages), budget)
    assert press is None
    return segs, how


def test_past_merging_the_oldest_are_read_deeper_then_left_out(model):
    messages = chat(8)
    older = [m["content"] for m in messages[1:-1]]
    level = deeper_level(model.encoder)[0]
    assert level == 16  # the tiny model's K=4 encoder over four of its merges
    segs = ktm.chat_prompt(model, messages, merge=False)
    plain = positions(model, segs)
    merged = positions(model, tuple(s.__class__(s.text, s.text.strip() in older, s.ids)
                                    for s in segs))
    deep = positions(model, tuple(s.__class__(s.text, True, s.ids, ratio=level)
                                  if s.text.strip() in older else s for s in segs))
    assert deep < merged < plain
    # under what merging all reaches: the oldest read deeper, the rest merged or plain
    segs, how = _history(model, messages, merged - 1)
    assert positions(model, segs) == how.positions <= merged - 1
    assert how.deeper > 0 and how.dropped == 0 and how.level == level
    read = [(s.text.strip(), s.ratio) for s in segs if s.text.strip() in older]
    assert [r for _, r in read[:how.deeper]] == [level] * how.deeper  # the oldest
    assert [r for _, r in read[how.deeper:how.deeper + how.merged]] == [None] * how.merged
    assert [t for t, _ in read] == older  # every one still read
    # under what reading them all deeper reaches: the oldest left out, as truncation does
    segs, how = _history(model, messages, deep - 1)
    assert positions(model, segs) <= deep - 1 and how.dropped > 0
    kept = [s.text.strip() for s in segs if s.text.strip() in older]
    assert kept == older[how.dropped:] and messages[1 + how.dropped]["role"] == "user"
    assert ktm.chat_prompt(model, messages, history_budget=deep - 1) == segs  # the library's
    assert _history(model, messages, plain)[1] == HistoryReading(plain, plain)


@pytest.fixture(scope="module")
def server(tiny_model_dir, model):
    cfg = ServeConfig(model=tiny_model_dir, served_name="tiny", batch_window_ms=50,
                      log_level="warning", history_budget=10**6)
    with BackgroundServer(create_app(model, cfg)) as srv:
        srv.model = model
        yield srv


def ask(server, messages, **ktm_field) -> dict:
    body = {"model": "tiny", "messages": messages, "max_tokens": 8, "temperature": 0}
    if ktm_field:
        body["ktm"] = ktm_field
    return post(server, body, "/v1/chat/completions")


def test_the_server_reads_a_chat_within_its_budget(server):
    messages = chat(5)
    plain = ask(server, messages, merge=False)
    under = ask(server, messages)  # the server's budget is far above this chat
    assert under["choices"][0]["message"] == plain["choices"][0]["message"]
    assert under["usage"]["prompt_tokens_merged"] == under["usage"]["prompt_tokens"]
    budget = plain["usage"]["prompt_tokens"] * 3 // 4
    over = ask(server, messages, history_budget=budget)
    assert over["usage"]["prompt_tokens_merged"] <= budget
    want = server.model.generate(ktm.chat_prompt(server.model, messages,
                                                 history_budget=budget), max_new_tokens=8)
    assert over["choices"][0]["message"]["content"] == want
    off = ask(server, messages, history_budget=0)  # the server's reading without a budget
    assert off["usage"]["prompt_tokens_merged"] < over["usage"]["prompt_tokens_merged"]


def growing(turns: int) -> list[dict]:
    """The chat a client sends at turn ``turns``: the one before, its answer and a new part
    (its own system message: no other test's chat shares its rows)."""
    msgs = chat(turns)
    return [{"role": "system", "content": "You answer growing chats."}, *msgs[1:-3], msgs[-3]]


def test_the_next_turn_reads_the_chat_before_it_from_the_prefix_cache(server):
    """A turn that merges no new block starts from the whole turn before it; one that does,
    from the merged history they share."""
    budget = 400
    merged, cached, rows = [], [], []
    for turns in (5, 6, 7, 8, 9):
        messages = growing(turns)
        r = ask(server, messages, history_budget=budget)
        merged.append(merged_contents(ktm.chat_prompt(server.model, messages,
                                                      history_budget=budget)))
        cached.append(r["usage"]["prompt_tokens_details"]["cached_tokens"])
        rows.append(r["usage"]["prompt_tokens_merged"])
    same = [i for i in range(1, 5) if merged[i] == merged[i - 1]]
    grew = [i for i in range(1, 5) if merged[i] != merged[i - 1]]
    assert same and grew  # both kinds of turn happen: the checks can fail
    for i in same:  # all of the turn before but its generation prompt
        assert rows[i - 1] - 10 < cached[i] < rows[i - 1]
    for i in grew:
        assert 0 < cached[i] < rows[i - 1] - 10


def test_a_chat_over_its_budget_gets_a_400_naming_the_numbers(server):
    client = openai_client(server)
    import openai

    with pytest.raises(openai.BadRequestError, match="history budget of 12"):
        client.chat.completions.create(model="tiny", messages=chat(3), max_tokens=4,
                                       extra_body={"ktm": {"history_budget": 12}})


def test_chats_under_load_answer_as_one_by_one(server):
    """Chats within and over their budgets, sent together with a dropped stream and a bad
    request among them, answer as each alone."""
    from concurrent.futures import ThreadPoolExecutor

    client = openai_client(server)
    asks = [(growing(t), budget) for t in (3, 4, 6, 7) for budget in (350, 10**6)]

    def one(i):
        messages, budget = asks[i]
        return ask(server, messages, history_budget=budget)["choices"][0]["message"]

    alone = [one(i) for i in range(len(asks))]

    def dropped():
        stream = client.chat.completions.create(model="tiny", messages=chat(6), max_tokens=64,
                                                stream=True, temperature=0)
        next(iter(stream))
        stream.close()

    def bad():
        import openai

        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model="tiny", messages=chat(3), max_tokens=4,
                                           extra_body={"ktm": {"history_budget": 12}})

    with ThreadPoolExecutor(10) as pool:
        extra = [pool.submit(dropped), pool.submit(bad)]
        together = list(pool.map(one, range(len(asks))))
        for f in extra:
            f.result()
    assert together == alone


# ---------------------------------------------------------------- --history-press
def reading(model, messages, budget, press, **ktm_field):
    from ktm.serving.prompts import chat_reading
    from ktm.serving.protocol import ChatRequest

    req = ChatRequest(model="tiny", messages=messages, ktm=ktm_field or None)
    return chat_reading(model, req, budget, press)[:2]


def test_a_history_press_reads_old_messages_plain_and_presses_them_to_fit(model):
    from ktm.decode.press import PressConfig, kept_positions

    messages = chat(5)
    plain = ktm.chat_prompt(model, messages, merge=False)
    full = positions(model, plain)
    segs, press = reading(model, messages, full, "knorm")  # fits: read as without a press
    assert press is None and segs == ktm.chat_prompt(model, messages, history_budget=full)
    budget = full // 3
    segs, press = reading(model, messages, budget, "knorm")
    assert positions(model, segs) == full  # every row plain
    old = [m["content"] for m in messages[1:-1]]
    assert merged_contents(segs) == old and all(s.ratio == 1.0 for s in segs if s.compress)
    cp = model.encode_prompts([segs], embed=False)[0]
    assert press.name == "knorm" and kept_positions(cp, press) <= budget
    # the least ratio that fits: a press keeping one position more would not
    assert kept_positions(cp, PressConfig("knorm", press.ratio - 1.5 / cp.pressable)) > budget
    # a press reaches budgets merging cannot (merging instead reads the oldest deeper or
    # leaves them out); a request may turn it off or name another
    segs, press = reading(model, messages, budget, "knorm", history_press="none")
    assert press is None and positions(model, segs) <= budget < positions(model, tuple(
        s.__class__(s.text, s.text.strip() in old, s.ids) for s in plain))
    segs, press = reading(model, messages, full * 3 // 4, "knorm", history_press="none")
    assert press is None and positions(model, segs) <= full * 3 // 4
    assert reading(model, messages, budget, None, history_press="tova")[1].name == "tova"


def test_a_history_press_is_refused_by_name_and_with_the_numbers(model):
    with pytest.raises(RequestError, match="unknown press 'nope'"):
        reading(model, chat(2), 10**6, "nope")
    with pytest.raises(RequestError, match=r"needs \d+ positions outside its older messages.*"
                                           r"history budget of 5"):
        reading(model, chat(3), 5, "knorm")
    for kw, match in (({}, "expected --history-budget"),
                      ({"history_budget": 100, "runtime": RuntimeSpec(press="knorm")},
                       "expected one"),
                      ({"history_budget": 100, "runtime": RuntimeSpec(backend="llamacpp")},
                       "llamacpp")):
        with pytest.raises(KTMError, match=match):
            ServeConfig(model="x", history_press="knorm", **kw)


def test_the_server_presses_a_chat_over_its_budget_as_the_model_would(server):
    from helpers import require_module

    require_module("kvpress", "the [kvpress] extra and kvpress (the README's test command)")
    messages = chat(5)
    plain = ask(server, messages, merge=False)
    budget = plain["usage"]["prompt_tokens"] // 3
    r = ask(server, messages, history_budget=budget, history_press="knorm")
    segs, press = reading(server.model, messages, budget, "knorm")
    runtime = server.model.runtime
    try:
        runtime.use_press(press)
        want = server.model.generate(segs, max_new_tokens=8)
    finally:
        runtime.use_press(None)
    assert r["choices"][0]["message"]["content"] == want
    assert r["usage"]["prompt_tokens_merged"] == plain["usage"]["prompt_tokens"]
    import openai

    with pytest.raises(openai.BadRequestError, match="both press"):
        openai_client(server).chat.completions.create(
            model="tiny", messages=messages, max_tokens=4, extra_body={"ktm": {
                "history_budget": budget, "history_press": "knorm", "press": "tova"}})


def _streamed(srv, messages) -> tuple[str, dict]:
    """A chat turn streamed as chat clients do (the openai client, usage asked): its text and
    usage."""
    parts, usage = [], None
    for chunk in openai_client(srv).chat.completions.create(
            model="tiny", messages=messages, max_tokens=8, temperature=0, stream=True,
            stream_options={"include_usage": True}):
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
    return "".join(parts), usage


@pytest.mark.parametrize("stream", [False, True])
def test_reading_ahead_serves_each_next_turn_up_to_its_new_message(tiny_model_dir, model,
                                                                    stream):
    """``--history-ahead``: after each answer the server reads the chat's next turn as it
    guesses it, so every next turn, those where a new block of history merges included, reads
    little more than its new message, and answers as the model does without a server; streamed
    or not."""
    cfg = ServeConfig(model=tiny_model_dir, served_name="tiny", batch_window_ms=0,
                      log_level="warning", history_budget=400, history_ahead=True)
    messages = [{"role": "system", "content": "You answer chats read ahead."},
                {"role": "user", "content": f"Part 0: {TEXT}"}]
    merged, cached, rows, new = [], [], [], []
    with BackgroundServer(create_app(model, cfg)) as srv:
        for turn in range(1, 8):
            if stream:
                answer, usage = _streamed(srv, messages)
            else:
                r = ask(srv, messages)
                answer, usage = r["choices"][0]["message"]["content"], r["usage"]
            assert answer == model.generate(ktm.chat_prompt(model, messages, history_budget=400),
                                            max_new_tokens=8)
            merged.append(merged_contents(ktm.chat_prompt(model, messages, history_budget=400)))
            cached.append(usage["prompt_tokens_details"]["cached_tokens"])
            rows.append(usage["prompt_tokens_merged"])
            new.append(len(model.tokenize(messages[-1]["content"])))
            # the turn read ahead after it (counted apart from the requests)
            assert _wait_until(lambda t=turn: get(srv, "/health")["read_ahead"] == t)
            assert get(srv, "/health")["finished"] == turn
            messages += [{"role": "assistant", "content": answer},
                         {"role": "user", "content": f"Part {turn}: {TEXT}"}]
    grew = [i for i in range(1, len(rows)) if merged[i] != merged[i - 1]]
    assert grew and merged[-1]  # turns that merge a new block happen: the check can fail
    for i in range(1, len(rows)):  # all but the new message and the template around it
        assert rows[i] - new[i] - 12 <= cached[i] < rows[i], (i, rows[i], cached[i], new[i])


class _Reads(ThreadPoolExecutor):
    """An executor of one thread that keeps the futures it was given: set as the server loop's
    default executor, where each answer's read ahead runs, it lets a test wait for every read
    ahead to end."""

    def __init__(self):
        super().__init__(max_workers=1)
        self.futures = []

    def submit(self, fn, /, *args, **kwargs):
        future = super().submit(fn, *args, **kwargs)
        self.futures.append(future)
        return future


def _reads_ahead(srv: BackgroundServer) -> _Reads:
    import asyncio

    loop, reads = srv.server.servers[0].get_loop(), _Reads()

    async def install() -> None:
        loop.set_default_executor(reads)

    asyncio.run_coroutine_threadsafe(install(), loop).result(timeout=30)
    return reads


def test_a_chat_read_with_a_press_reads_nothing_ahead(tiny_model_dir, model, monkeypatch):
    """A pressed prompt is read whole every turn (no rows reused): ``--history-ahead`` reads
    nothing for it, whether the request names the press or the server's history press would."""
    from concurrent.futures import wait

    cfg = ServeConfig(model=tiny_model_dir, served_name="tiny", batch_window_ms=0,
                      log_level="warning", history_budget=400, history_ahead=True)
    messages = [{"role": "system", "content": "You answer chats read with a press."},
                {"role": "user", "content": f"Part 0: {TEXT}"}]
    app = create_app(model, cfg)
    engine, queued = app.state.engine, []
    submit = engine.submit
    monkeypatch.setattr(engine, "submit", lambda *jobs: queued.extend(j.ahead for j in jobs)
                        or submit(*jobs))
    with BackgroundServer(app) as srv:
        reads = _reads_ahead(srv)
        for press, ahead in ((True, 0), (False, 1), (True, 1)):
            # the same chat, with a press and without: only the one without is read ahead
            ask(srv, messages, **({"press": "knorm", "press_ratio": 0.5} if press else {}))
            wait(reads.futures)  # the answer's read ahead, to its end
            assert sum(queued) == ahead, (press, queued)
        assert len(reads.futures) == 3 and all(f.exception() is None for f in reads.futures)
        assert _wait_until(lambda: get(srv, "/health")["read_ahead"] == 1)
        assert get(srv, "/health")["finished"] == 3


def test_a_chat_that_outgrows_its_budget_keeps_being_answered(tiny_model_dir, model):
    """64 turns under a budget of 300 positions (the tiny model's context is 512): every turn is
    answered as the model answers that chat, its prompt within the budget; its ``ktm`` field
    (streamed: in the first chunk) says how the history was read, and ``/metrics`` counts it."""
    from test_serve_exposed import metrics

    budget = 300
    cfg = ServeConfig(model=tiny_model_dir, served_name="tiny", batch_window_ms=0,
                      log_level="warning", history_budget=budget)
    messages = [{"role": "system", "content": "You answer a chat that never ends."},
                {"role": "user", "content": f"Part 0: {TEXT}"}]
    readings = []
    with BackgroundServer(create_app(model, cfg)) as srv:
        client = openai_client(srv)
        for turn in range(1, 65):
            kw = dict(model="tiny", messages=messages, max_tokens=6, temperature=0)
            if turn % 2:
                r = client.chat.completions.create(**kw)
                answer, usage, ext = r.choices[0].message.content, r.usage, r.model_extra["ktm"]
            else:
                chunks = list(client.chat.completions.create(
                    stream=True, stream_options={"include_usage": True}, **kw))
                answer = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                usage, ext = chunks[-1].usage, chunks[0].model_extra["ktm"]
                assert all("ktm" not in c.model_extra for c in chunks[1:])
            how = HistoryReading(**ext["history"])
            assert usage.prompt_tokens_merged == how.positions <= budget
            if turn % 16 == 0:
                segs = ktm.chat_prompt(model, messages, history_budget=budget)
                assert answer == model.generate(segs, max_new_tokens=6)
            readings.append(how)
            messages += [{"role": "assistant", "content": answer},
                         {"role": "user", "content": f"Part {turn}: {TEXT}"}]
        after = metrics(srv)
    assert readings[0].merged == 0 and readings[-1].dropped > 0
    assert any(r.deeper and not r.dropped for r in readings)  # read deeper before leaving out
    for step in ("merged", "deeper", "dropped"):
        assert after[("ktm:history_messages_total", (("reading", step),))] == sum(
            getattr(r, step) for r in readings)
    furthest = [next((s for s in ("dropped", "deeper", "merged") if getattr(r, s)), "plain")
                for r in readings]
    for step in set(furthest):
        assert after[("ktm:history_requests_total", (("reading", step),))] == furthest.count(step)
