"""The save session state machine: its table, its gates, and a rule-based model of it."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pitstop.core.session import (
    NO_FAILURE,
    TRANSITIONS,
    Event,
    FailedSave,
    IllegalTransition,
    Phase,
    Request,
    SaveStatus,
    Session,
    Until,
    WriterStep,
    advance,
    after_failed_copy,
    after_raise,
    claim_copy,
    gate,
    left_by_raise,
    may_release,
    reads_live,
    satisfied,
    save_status,
    settles_first,
    waits_for_uploads,
    writer_step,
)
from pitstop.errors import PitstopError

SAVING = {Phase.CAPTURING, Phase.DEFERRED, Phase.COPYING, Phase.WRITING}


@pytest.mark.parametrize(("phase", "event"), list(itertools.product(Phase, Event)))
def test_every_pair_outside_the_table_is_illegal(phase: Phase, event: Event) -> None:
    session = Session(background=True, phase=phase, ticket=1, step=5, name="step_5")
    if (phase, event) in TRANSITIONS:
        assert advance(session, event).phase is TRANSITIONS[phase, event]
    else:
        with pytest.raises(IllegalTransition, match=phase.value) as raised:
            advance(session, event)
        assert isinstance(raised.value, PitstopError)
        assert "step 5" in str(raised.value)


def test_a_background_save_from_begin_to_published() -> None:
    session = Session(background=True)
    session = advance(session, Event.BEGIN, step=3, name="step_000000000003.pitstop")
    assert (session.phase, session.ticket, session.step) == (Phase.CAPTURING, 1, 3)
    assert reads_live(session)
    session = advance(session, Event.DEFER)
    assert claim_copy(session)
    assert not satisfied(session, Until.COPIED)
    session = advance(session, Event.CLAIM)
    assert not claim_copy(session)  # one thread copies
    session = advance(session, Event.COPIED)
    assert not reads_live(session)
    assert satisfied(session, Until.COPIED)
    assert not satisfied(session, Until.SETTLED)
    assert save_status(session, 1) is SaveStatus.PENDING
    session = advance(session, Event.PUBLISHED)
    assert satisfied(session, Until.SETTLED)
    assert save_status(session, 1) is SaveStatus.PUBLISHED


def test_a_job_whose_save_failed_writes_nothing_of_the_next_save() -> None:
    """The writer took save 1's job; its copy failed, was reported, and save 2 began: the old
    job claims none of save 2's copies, and whatever save 2's phase, it writes nothing."""
    session = Session(background=True)
    session = advance(session, Event.BEGIN, step=1, name="step_1")
    session = advance(session, Event.DEFER)
    assert claim_copy(session, 1)
    assert writer_step(session, 1) is WriterStep.DROP  # nothing copied yet: the writer claims
    session = advance(session, Event.CLAIM)
    assert writer_step(session, 1) is WriterStep.WAIT  # the loop copies
    session = advance(advance(session, Event.FAILED), Event.REPORTED)
    assert writer_step(session, 1) is WriterStep.DROP
    session = advance(session, Event.BEGIN, step=2, name="step_2")
    session = advance(session, Event.DEFER)
    assert not claim_copy(session, 1)
    assert claim_copy(session, 2)
    assert claim_copy(session)  # the loop's thread: whichever save is in flight
    session = advance(advance(session, Event.CLAIM), Event.COPIED)
    assert writer_step(session, 1) is WriterStep.DROP
    assert writer_step(session, 2) is WriterStep.WRITE


def test_a_synchronous_save_reads_the_live_state_while_it_writes() -> None:
    session = advance(Session(background=False), Event.BEGIN, step=1, name="a")
    session = advance(session, Event.CAPTURED)
    assert reads_live(session)
    background = advance(advance(Session(background=True), Event.BEGIN), Event.CAPTURED)
    assert not reads_live(background)


def test_a_failure_is_named_and_reported_once() -> None:
    session = advance(Session(background=True), Event.BEGIN, step=7, name="step_7")
    session = advance(advance(session, Event.CAPTURED), Event.FAILED)
    assert session.failure != NO_FAILURE
    assert (session.failure.step, session.failure.name) == (7, "step_7")  # type: ignore[union-attr]
    assert save_status(session, 1) is SaveStatus.FAILED
    for request in Request:
        assert gate(session, request).until is not Until.SETTLED or satisfied(
            session, Until.SETTLED
        )
    session = advance(session, Event.REPORTED)
    assert session.failure is NO_FAILURE
    assert save_status(session, 1) is SaveStatus.FAILED  # still known as failed


@pytest.mark.parametrize(("on_loop", "interrupt"), list(itertools.product([True, False], repeat=2)))
def test_a_failed_copy_is_raised_at_once_only_when_it_interrupted_the_loops_thread(
    on_loop: bool, interrupt: bool
) -> None:
    event = after_failed_copy(on_loop=on_loop, interrupt=interrupt)
    assert event is (Event.INTERRUPTED if on_loop and interrupt else Event.FAILED)


def test_an_interrupted_copy_fails_its_save_and_reporting_it_only_undoes_it() -> None:
    session = advance(Session(background=True), Event.BEGIN, step=4, name="step_4")
    session = advance(advance(session, Event.DEFER), Event.CLAIM)
    session = advance(session, Event.INTERRUPTED)
    assert session.phase is Phase.FAILED
    assert session.failure == FailedSave(ticket=1, step=4, name="step_4", raised=True)
    assert save_status(session, 1) is SaveStatus.FAILED
    assert not reads_live(session)
    assert may_release(session)  # the writer writes nothing of it
    session = advance(session, Event.REPORTED)
    assert (session.phase, session.failure) == (Phase.IDLE, NO_FAILURE)
    assert save_status(session, 1) is SaveStatus.FAILED
    failed = advance(advance(Session(background=True), Event.BEGIN), Event.CAPTURED)
    assert not advance(failed, Event.FAILED).failure.raised  # type: ignore[union-attr]


@pytest.mark.parametrize("request_", list(Request))
def test_every_call_but_the_optimizer_hook_raises_a_pending_failure(request_: Request) -> None:
    assert gate(Session(background=True), request_).raise_failure is (request_ is not Request.STEP)


@pytest.mark.parametrize(
    ("request_", "until"),
    [
        (Request.SAVE, Until.NOW),
        (Request.LIST, Until.NOW),
        (Request.REGISTER, Until.COPIED),
        (Request.STEP, Until.COPIED),
        (Request.WRITE, Until.SETTLED),
        (Request.RESUME, Until.SETTLED),
        (Request.WAIT, Until.SETTLED),
        (Request.CLOSE, Until.SETTLED),
    ],
)
def test_what_each_call_waits_for(request_: Request, until: Until) -> None:
    assert gate(Session(background=True), request_).until is until
    assert settles_first(request_) is (until is Until.SETTLED)


@pytest.mark.parametrize("request_", list(Request))
def test_a_closed_session_refuses_all_but_close_the_hook_and_listing(request_: Request) -> None:
    closed = advance(Session(background=True), Event.CLOSE)
    rule = gate(closed, request_)
    assert rule.until is Until.NOW
    assert bool(rule.refuse) is (request_ not in (Request.CLOSE, Request.STEP, Request.LIST))


@pytest.mark.parametrize("phase", list(Phase))
def test_the_directory_may_be_released_only_with_no_save_in_flight(phase: Phase) -> None:
    """A writer may write while a save is in flight: close() keeps the lock until it settles."""
    session = Session(background=True, phase=phase, ticket=1, step=5, name="step_5")
    assert may_release(session) is (phase not in SAVING)
    assert may_release(session) is satisfied(session, Until.SETTLED)  # what close() waits for


def test_an_unknown_ticket_is_an_error() -> None:
    with pytest.raises(ValueError, match="no save numbered 1"):
        save_status(Session(background=True), 1)


@pytest.mark.parametrize("background", [False, True])
@pytest.mark.parametrize("phase", list(Phase))
def test_a_call_that_raised_aborts_only_its_own_save(background: bool, phase: Phase) -> None:
    session = Session(background=background, phase=phase, ticket=3, step=30, name="step_30")
    own = phase is Phase.CAPTURING or (not background and phase in SAVING)
    assert left_by_raise(session) is own
    if own:  # ending it is legal, and the save counts as failed
        after = advance(session, Event.ABORTED)
        assert after.phase is Phase.IDLE
        assert save_status(after, 3) is SaveStatus.FAILED
        assert after.failure is NO_FAILURE  # the call raises the error itself


@pytest.mark.parametrize("published", [False, True])
@pytest.mark.parametrize("background", [False, True])
@pytest.mark.parametrize("phase", list(Phase))
def test_a_call_that_raised_ends_only_its_own_save_and_counts_a_published_one(
    phase: Phase, background: bool, published: bool
) -> None:
    session = Session(background=background, phase=phase, ticket=3, step=5, name="step_5")
    event = after_raise(session, published=published)
    if not left_by_raise(session):
        assert event is None  # the writer's, or over: not the call's to end
        return
    assert (phase, event) in TRANSITIONS  # always a legal ending
    assert event is (Event.PUBLISHED if published and phase is Phase.WRITING else Event.ABORTED)
    after = advance(session, event)
    assert save_status(after, 3) is (
        SaveStatus.PUBLISHED if event is Event.PUBLISHED else SaveStatus.FAILED
    )


class SessionMachine(RuleBasedStateMachine):
    """The session against a plain model: one save in flight, each outcome known, errors once.

    Rules follow the life of a save (save / copy-finished / write-finished / write-failed) and
    the calls that may come at any time (resume / register / close / drop), each asking its
    gate first and only going on when the gate is satisfied, as the shell does.
    """

    def __init__(self) -> None:
        super().__init__()
        self.session = Session(background=True)
        self.in_flight = False
        self.outcomes: dict[int, SaveStatus] = {}
        self.pending_error = False
        self.pending_interrupt = False  # the pending failure's thread raised it already
        self.raised = 0
        self.failures = 0
        self.undone = 0
        self.closed = False

    def _call(self, request: Request) -> bool:
        """Ask the gate as the shell does; False when the call would have to wait."""
        rule = gate(self.session, request)
        if rule.refuse:
            assert self.closed
            return False
        if not satisfied(self.session, rule.until):
            assert self.in_flight
            return False
        if rule.raise_failure and self.session.failure is not NO_FAILURE:
            assert self.pending_error
            assert self.session.failure.raised is self.pending_interrupt
            self.session = advance(self.session, Event.REPORTED)
            self.pending_error = False
            if self.pending_interrupt:  # only undone: the interrupt was raised already
                self.undone += 1
            else:
                self.raised += 1
            self.pending_interrupt = False
        return True

    @precondition(lambda self: not self.closed)
    @rule(deferred=st.booleans(), step=st.integers(0, 10**6))
    def save(self, deferred: bool, step: int) -> None:
        if not self._call(Request.SAVE) or not self._call(Request.WRITE):
            return
        assert not self.in_flight
        self.session = advance(self.session, Event.BEGIN, step=step, name=f"step_{step}")
        self.session = advance(self.session, Event.DEFER if deferred else Event.CAPTURED)
        self.in_flight = True
        self.outcomes[self.session.ticket] = SaveStatus.PENDING

    @precondition(lambda self: not self.closed)
    @rule(step=st.integers(0, 10**6))
    def save_raises_while_capturing(self, step: int) -> None:
        """The save call raises on the loop's thread after BEGIN, before it handed anything over
        (its capture failed, its writer thread could not start, a fault between the plan and
        the write): the call ends it, the save failed, and no error is pending — the caller
        has it."""
        if not self._call(Request.SAVE) or not self._call(Request.WRITE):
            return
        self.session = advance(self.session, Event.BEGIN, step=step, name=f"step_{step}")
        assert left_by_raise(self.session)
        self.session = advance(self.session, Event.ABORTED)
        self.outcomes[self.session.ticket] = SaveStatus.FAILED

    @rule()
    def a_later_call_raises(self) -> None:
        """A call that raises between saves never ends the writer's save in flight."""
        assert not left_by_raise(self.session)

    @precondition(lambda self: self.session.phase in (Phase.DEFERRED, Phase.COPYING))
    @rule()
    def copy_finished(self) -> None:
        if claim_copy(self.session):
            self.session = advance(self.session, Event.CLAIM)
        self.session = advance(self.session, Event.COPIED)

    @precondition(lambda self: self.session.phase is Phase.WRITING)
    @rule()
    def write_finished(self) -> None:
        self.session = advance(self.session, Event.PUBLISHED)
        self.in_flight = False
        self.outcomes[self.session.ticket] = SaveStatus.PUBLISHED

    @precondition(lambda self: self.session.phase in (Phase.DEFERRED, Phase.COPYING))
    @rule()
    def copy_interrupted(self) -> None:
        """A Ctrl-C while the loop's thread makes the deferred copies: raised there and then."""
        if claim_copy(self.session):
            self.session = advance(self.session, Event.CLAIM)
        self.session = advance(self.session, Event.INTERRUPTED)
        self.in_flight = False
        self.pending_error = self.pending_interrupt = True
        self.outcomes[self.session.ticket] = SaveStatus.FAILED

    @precondition(lambda self: self.session.phase in SAVING - {Phase.CAPTURING})
    @rule()
    def write_failed(self) -> None:
        self.session = advance(self.session, Event.FAILED)
        self.in_flight = False
        self.pending_error = True
        self.failures += 1
        self.outcomes[self.session.ticket] = SaveStatus.FAILED

    @rule(request=st.sampled_from([Request.RESUME, Request.REGISTER, Request.LIST, Request.WAIT]))
    def call(self, request: Request) -> None:
        went_on = self._call(request)
        if went_on and request in (Request.RESUME, Request.WAIT):
            assert not self.in_flight  # the directory includes the save
        if went_on and request is Request.REGISTER:
            assert not reads_live(self.session)

    @rule()
    def optimizer_step(self) -> None:
        if self._call(Request.STEP):
            assert not reads_live(self.session)

    @precondition(lambda self: not self.in_flight)
    @rule()
    def close(self) -> None:
        if self._call(Request.CLOSE) and not self.closed:
            self.session = advance(self.session, Event.CLOSE)
            self.closed = True

    @precondition(lambda self: not self.in_flight and not self.closed)
    @rule()
    def drop(self) -> None:
        """A dropped Checkpointer's finalizer closes it: a failure nobody raised is dropped."""
        self.session = advance(self.session, Event.CLOSE)
        self.closed = True
        self.pending_error = self.pending_interrupt = False

    @rule(event=st.sampled_from(list(Event)))
    def any_event(self, event: Event) -> None:
        """An event the table does not allow raises and changes nothing."""
        if (self.session.phase, event) in TRANSITIONS:
            return
        before = self.session
        with pytest.raises(IllegalTransition):
            advance(self.session, event)
        assert self.session == before

    @invariant()
    def one_save_in_flight_and_every_outcome_known(self) -> None:
        assert (self.session.phase in SAVING) is self.in_flight
        assert may_release(self.session) is not self.in_flight
        for ticket, status in self.outcomes.items():
            assert save_status(self.session, ticket) is status
        assert (self.session.failure is not NO_FAILURE) is self.pending_error
        failure = self.session.failure
        assert (failure is not NO_FAILURE and failure.raised) is self.pending_interrupt
        assert self.raised <= self.failures

    @invariant()
    def a_writers_job_writes_only_its_own_save_while_it_is_in_flight(self) -> None:
        for ticket, status in self.outcomes.items():
            step = writer_step(self.session, ticket)
            if status is not SaveStatus.PENDING:  # ended: its job writes and claims nothing
                assert step is WriterStep.DROP
                assert not claim_copy(self.session, ticket)
            elif self.session.phase is Phase.WRITING:
                assert step is WriterStep.WRITE
            elif self.session.phase is Phase.COPYING:
                assert step is WriterStep.WAIT
            else:
                assert step is WriterStep.DROP
                assert claim_copy(self.session, ticket) is (self.session.phase is Phase.DEFERRED)


TestSessionMachine = SessionMachine.TestCase


@pytest.mark.parametrize("request_", list(Request))
def test_the_runs_end_and_a_resume_wait_for_a_remote_tiers_uploads(request_: Request) -> None:
    # A save never waits for an upload (the local publish keeps today's speed); the end of the
    # run does (finish, wait, close), and a resume, which reads the remote tier.
    ends = {Request.WAIT, Request.CLOSE, Request.RESUME}
    assert waits_for_uploads(request_) is (request_ in ends)
    if request_ in ends:
        assert settles_first(request_)  # the save in flight is published (and queued) first
