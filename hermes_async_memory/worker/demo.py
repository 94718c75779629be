"""``--demo``: a short scripted load that shows the pipeline at work, in plain lines on stdout.

Fifty made-up sessions (ten users, five topics each) of twenty turns are accepted the way a
gateway would: turn by turn, round-robin over sessions, each ``sync_turn`` timed. Then a
flush, a prefetch queued ahead of the next turn, a search across one user's sessions, the
pipeline's stats, and the shutdown.
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass
from typing import TextIO

from hermes_async_memory import MemoryPipeline, PipelineStats, Receipt
from hermes_async_memory.stats import percentile

SESSIONS = 50
TURNS_PER_SESSION = 20
USERS = ("ada", "grace", "linus", "margaret", "alan", "barbara", "ken", "radia", "edsger",
         "frances")
# Every few sessions queue a recall ahead of their next turn, as a gateway does.
PREFETCH_EVERY = 5
_SEED = 20240611
_INDENT = "    "

CITIES = ("Kyoto", "Lisbon", "Oaxaca", "Tallinn", "Hanoi", "Valparaiso")
DISHES = ("ramen", "sourdough", "mole negro", "pho", "paella", "dal makhani")
PROJECTS = ("the billing service", "the photo app", "the CLI", "the data pipeline")
PLANTS = ("tomatoes", "basil", "lavender", "blueberries", "courgettes", "chillies")
RACES = ("a 10k in April", "a half marathon in May", "a trail 25k in June",
         "a marathon in October")
# Slots filled anew on every turn, so no two turns of a session read alike.
TURN_SLOTS: dict[str, tuple[str, ...]] = {
    "sight": ("the old market", "the harbour walk", "the hilltop temple", "the botanical "
              "garden", "the night market", "the tiled chapel", "the river ferry"),
    "food": ("grilled sardines", "custard tarts", "tlayudas", "bun cha", "street dumplings",
             "smoked eel", "empanadas"),
    "ingredient": ("miso", "rye starter", "ancho chiles", "star anise", "saffron",
                   "black lentils", "smoked paprika", "kombu"),
    "bug": ("a KeyError in the config loader", "a deadlock in the upload worker",
            "a flaky timezone test", "a memory leak in the image cache",
            "an off-by-one in the pager", "a race in the retry queue"),
    "pest": ("aphids", "slugs", "whitefly", "powdery mildew", "snails", "blackbirds"),
    "distance": ("8 km", "12 km", "16 km", "21 km", "5 km of intervals", "a hilly 10 km"),
}

# (user, assistant) templates per topic; {n} is the turn number.
TOPICS: dict[str, tuple[tuple[str, str], ...]] = {
    "trip": (
        ("Day {n} in {city}: is {sight} worth the queue?",
         "Go to {sight} before nine, when it is quiet; the light is best then."),
        ("Where do locals eat {food} in {city}?",
         "Skip the square; two streets north of the station a small counter does {food}."),
        ("Is {sight} all right with a toddler on day {n}?",
         "Yes: it is flat and shaded, with benches every hundred metres."),
        ("Rain is forecast for day {n}. Indoor ideas in {city}?",
         "The city museum is free on weekdays; {sight} has a covered part too."),
        ("How long from the airport to {sight} in {city}?",
         "About forty minutes on the express train; buy the ticket at the machine."),
    ),
    "cooking": (
        ("My {dish} came out bland on try {n}. More {ingredient}?",
         "Add the {ingredient} earlier and taste at the end; salt is the usual culprit."),
        ("Can I swap the {ingredient} in the {dish} for something from a supermarket?",
         "You can, but halve the amount: the substitute is stronger."),
        ("How long does {dish} with {ingredient} keep in the fridge?",
         "Three days in a closed box; the flavour is often better on day two."),
        ("Cooking {dish} for {n} people on Saturday. How much {ingredient}?",
         "Scale the {ingredient} by eye past eight people, not by the recipe's arithmetic."),
        ("What goes well with {dish} besides {food}?",
         "A sharp green salad and something pickled to cut the richness."),
    ),
    "code": (
        ("In {project} I am chasing {bug}; it shows up once in {n} runs.",
         "Log the inputs of the failing call and make it reproducible before fixing it."),
        ("The stack trace for {bug} points at the retry wrapper in {project}.",
         "Then the wrapper swallows the first error: re-raise it with its cause."),
        ("Should I add a regression test for {bug} in {project}?",
         "Yes: a test that fails without the fix, named after what the user saw."),
        ("Review my fix for {bug}: I put a lock around the cache.",
         "The lock works, but hold it only around the dict update, not the I/O."),
        ("{project} deploys take {n} minutes. Where would you look first?",
         "At the image build: cache the dependency layer and most of it goes away."),
    ),
    "garden": (
        ("Week {n}: my {plant} have yellow leaves. Too much water?",
         "Probably: let the top two centimetres of soil dry between waterings."),
        ("There are {pest} on the {plant}. What now?",
         "Pick off what you can, then spray with soapy water in the evening."),
        ("When should the {plant} go outside? Week {n} looks mild.",
         "After the last frost, hardened off for a week first."),
        ("What can I plant next to {plant} against {pest}?",
         "Marigolds keep many pests away and do not compete for the same nutrients."),
        ("Do {plant} in pots need feeding, or does that attract {pest}?",
         "Every two weeks in summer, with a diluted liquid feed."),
    ),
    "running": (
        ("Training for {race}, week {n}: my knees ache after {distance}.",
         "Cut the long run by a fifth this week and add two strength sessions."),
        ("What pace for easy {distance} runs before {race}?",
         "Slow enough to talk in full sentences; most runners go too fast."),
        ("Ran {distance} today and felt great. Add more?",
         "Keep the weekly rise under ten per cent, even on good weeks."),
        ("What should I eat the night before {race}? I like {food}.",
         "Something plain you have eaten before long runs; nothing new on race week."),
        ("How do I taper for {race} after a {distance} week?",
         "Drop the volume by a third in each of the last two weeks; keep some pace work."),
    ),
}
TOPIC_ORDER = tuple(TOPICS)
NEXT_QUESTION = {
    "trip": "Any food tips for {city}? We loved the {dish} we made at home.",
    "cooking": "Could I take {dish} on a picnic?",
    "code": "Is the bug in {project} fixed in the last release?",
    "garden": "Will my {plant} survive a cold night?",
    "running": "Am I ready for {race}?",
}


@dataclass(frozen=True)
class DemoSession:
    session_id: str
    user_id: str
    topic: str
    details: dict[str, str]

    def turn(self, n: int, rng: random.Random) -> tuple[str, str]:
        """Turn ``n`` (from 0): the topic's templates in turn, with fresh slots."""
        templates = TOPICS[self.topic]
        user, assistant = templates[n % len(templates)]
        slots = {name: rng.choice(pool) for name, pool in TURN_SLOTS.items()}
        values = {**self.details, **slots, "n": str(n + 2)}
        return user.format(**values), assistant.format(**values)


def make_sessions(run_id: str) -> list[DemoSession]:
    """Ten users with five sessions each, one per topic; a user's details hold across them."""
    per_user = len(TOPIC_ORDER)
    sessions = []
    for i in range(SESSIONS):
        name = USERS[(i // per_user) % len(USERS)]
        user_rng = random.Random(f"{_SEED}:{name}")
        details = {
            "city": user_rng.choice(CITIES), "dish": user_rng.choice(DISHES),
            "project": user_rng.choice(PROJECTS), "plant": user_rng.choice(PLANTS),
            "race": user_rng.choice(RACES),
        }
        sessions.append(DemoSession(
            session_id=f"demo-{run_id}-{i:02d}",
            user_id=f"demo:{name}",
            topic=TOPIC_ORDER[i % per_user],
            details=details,
        ))
    return sessions


async def run_demo(mem: MemoryPipeline, out: TextIO) -> None:
    """Run the scripted load on an open pipeline and print what happens; the caller closes it."""

    def say(line: str = "") -> None:
        print(line, file=out, flush=True)

    run_id = os.urandom(3).hex()
    rng = random.Random(_SEED)
    sessions = make_sessions(run_id)
    total = SESSIONS * TURNS_PER_SESSION
    say(f"hermes-memory demo (run {run_id}): {SESSIONS} sessions x {TURNS_PER_SESSION} turns "
        f"of made-up chat from {len(USERS)} users")
    say(f"store: {mem.settings.db_path}")
    say()

    # All but the last turn of every session, round-robin, as concurrent gateways would send.
    timings_ns: list[int] = []
    receipts: list[Receipt] = []

    def accept(n: int) -> None:
        for s in sessions:
            user, assistant = s.turn(n, rng)
            t0 = time.perf_counter_ns()
            receipt = mem.sync_turn(user, assistant, session_id=s.session_id, user_id=s.user_id,
                                    metadata={"source": "demo", "model": "demo-model"})
            timings_ns.append(time.perf_counter_ns() - t0)
            receipts.append(receipt)

    started = time.perf_counter()
    for n in range(TURNS_PER_SESSION - 1):
        accept(n)
    t0 = time.perf_counter()
    await mem.flush()
    first_flush_ms = (time.perf_counter() - t0) * 1000

    # The last turn: a gateway queues the recall for the session's next turn right away, so
    # it runs while the turn is written and waits in the cache when the next turn arrives.
    prefetched = sessions[::PREFETCH_EVERY]
    for s in prefetched:
        mem.queue_prefetch(NEXT_QUESTION[s.topic].format(**s.details), session_id=s.session_id,
                           user_id=s.user_id)
    accept(TURNS_PER_SESSION - 1)
    t0 = time.perf_counter()
    await mem.flush()
    last_flush_ms = (time.perf_counter() - t0) * 1000
    elapsed_ms = (time.perf_counter() - started) * 1000

    micros = [ns / 1000 for ns in timings_ns]
    deferred = sum(r.deferred for r in receipts)
    say(f"accepted {len(receipts)} turns with sync_turn: p50 {percentile(micros, 0.50):.1f} us, "
        f"p99 {percentile(micros, 0.99):.1f} us, max {max(micros):.1f} us; "
        f"{deferred} deferred (durable in the outbox, committed later)")
    say(f"flushed {total - SESSIONS} turns in {first_flush_ms:.1f} ms, then the last "
        f"{SESSIONS} in {last_flush_ms:.1f} ms: all {total} committed and recallable "
        f"({elapsed_ms:.0f} ms from first accept)")
    say(f"queued a prefetch for {len(prefetched)} sessions ahead of their next turn")
    say()

    shown = prefetched[0]
    try:  # the recall queued before the last turn lands within milliseconds
        await mem.wait_until(lambda: mem.prefetch_status(
            shown.session_id, user_id=shown.user_id).recall_query is not None, timeout=2.0)
    except TimeoutError:
        pass  # the block below says the recall is still running
    block = mem.prefetch(session_id=shown.session_id, user_id=shown.user_id)
    status = mem.prefetch_status(shown.session_id, user_id=shown.user_id)
    say(f"prefetch(session_id={shown.session_id!r}), a dict lookup with no I/O:")
    say(_indent(block or "(empty)"))
    say(f"prefetch_status: turns_committed={status.turns_committed} "
        f"last_turn_key={status.last_turn_key} committed {_age(status.committed_age_s)}; "
        + (f"recall {status.recall_query!r} {_age(status.recall_age_s)} from {status.source}"
           if status.recall_query is not None else "recall still running"))
    say()

    query = f"{shown.details['dish']} fridge"
    t0 = time.perf_counter()
    found = await mem.search(query, user_id=shown.user_id)
    search_ms = (time.perf_counter() - t0) * 1000
    say(f"search({query!r}, user_id={shown.user_id!r}) across the user's sessions, "
        f"{search_ms:.1f} ms:")
    say(_indent(found or "(no match)"))
    say()

    st = mem.stats()
    say(f"stats: {st.accepted_turns} accepted, {st.committed_turns} committed in "
        f"{st.batches_committed} batches ({st.rows_committed} rows); write-to-recallable "
        f"p50 {st.write_to_recallable_p50_ms:.1f} ms, p99 {st.write_to_recallable_p99_ms:.1f} ms; "
        f"recalls run {st.recalls_run}, shared {st.recalls_shared}; prefetch hits "
        f"{st.recall_hits}, misses {st.recall_misses}; dead letters {st.dead_letters}")



def print_closed(stats: PipelineStats, out: TextIO) -> None:
    """The demo's last line, once the worker has closed the pipeline."""
    left = stats.accepted_turns - stats.committed_turns
    print(f"flushed; {stats.committed_turns} turns committed, {left} left in outbox", file=out,
          flush=True)


def _indent(text: str) -> str:
    return "\n".join(_INDENT + line for line in text.splitlines())


def _age(seconds: float | None) -> str:
    return "never" if seconds is None else f"{seconds * 1000:.0f} ms ago"
