"""The point-to-point plan of a schedule: what each rank sends and receives, batched how, and a
replay proving the plan can neither mismatch nor deadlock under NCCL's rules.

NCCL ignores tags: between two ranks, the i-th send one way meets the i-th receive posted for it
(FIFO per direction), and a rank's P2P batches run one after another on one stream, a send ending
only once its receiver's batch runs (large messages are not buffered). So the posting order is the
protocol: in 1F1B with separate sends and receives, rank 0 queues "send activation 1" before
"receive gradient 0" while rank 1 queues "send gradient 0" before "receive activation 1", and both
wait forever. Every rank posts ``batch_isend_irecv`` batches along rounds of one global clock
(``comm_plan``), and ``check_comm_plan`` replays all ranks' batches under these rules, so the runner
refuses traffic that could hang or pair the wrong tensors, on every rank alike, before any rank
communicates.
"""
from __future__ import annotations

from dataclasses import dataclass

from .simulate import ScheduleError, simulate


@dataclass(frozen=True)
class Msg:
    send: bool
    peer: int  # pipeline rank at the other end
    what: str  # "shape" (of the boundary's activations, this step), "activation" or "gradient"
    boundary: int  # the boundary crossed, between stage `boundary` and stage `boundary + 1`
    microbatch: int

    @property
    def label(self) -> tuple:
        return self.what, self.boundary, self.microbatch

    def __str__(self) -> str:
        way = f"send to rank {self.peer}" if self.send else f"receive from rank {self.peer}"
        return f"{way}: {self.what} {self.boundary}->{self.boundary + 1} microbatch {self.microbatch}"


def announcing_microbatch(schedule, boundary: int) -> int:
    """The microbatch whose activation carries ``boundary``'s shape message: the first the sending
    stage runs forward. Named by the sender's order on both ends: a schedule may run the receiving
    stage's forwards in another order (its first forward then waits for that message, which the
    sender's first forward, ending no later than any other, has already sent)."""
    return next(a.microbatch for a in schedule.actions[schedule.rank_of(boundary)]
                if a.op == "F" and a.stage == boundary)


def _traffic(schedule, rank: int, action, announced: set) -> tuple[list, list]:
    """(receives the action needs, sends it makes); ``announced`` tracks the boundaries whose
    activation shape already crossed this step (the sender's first activation across one carries it)."""
    s, mb, last, owner = action.stage, action.microbatch, schedule.num_stages - 1, schedule.rank_of
    recvs, sends = [], []
    if action.op == "F":
        if s > 0 and owner(s - 1) != rank:
            if s - 1 not in announced:
                announced.add(s - 1)
                recvs.append(Msg(False, owner(s - 1), "shape", s - 1, announcing_microbatch(schedule, s - 1)))
            recvs.append(Msg(False, owner(s - 1), "activation", s - 1, mb))
        if s < last and owner(s + 1) != rank:
            if s not in announced:  # (this F is the sender's first of stage s: announcing_microbatch)
                announced.add(s)
                sends.append(Msg(True, owner(s + 1), "shape", s, mb))
            sends.append(Msg(True, owner(s + 1), "activation", s, mb))
    elif action.op in ("B", "BW"):
        if s < last and owner(s + 1) != rank:
            recvs.append(Msg(False, owner(s + 1), "gradient", s, mb))
        if s > 0 and owner(s - 1) != rank:
            sends.append(Msg(True, owner(s - 1), "gradient", s - 1, mb))
    return recvs, sends


def _ordered(rank: int, msgs: list) -> tuple:
    # NCCL runs a batch's operations together, so their order inside it is free there; even ranks
    # put sends first and odd ranks receives first (Megatron's even/odd rule) so that a backend
    # running a batch one operation at a time still finds its neighbour's matching op waiting.
    sends = [m for m in msgs if m.send]
    recvs = [m for m in msgs if not m.send]
    return tuple(sends + recvs) if rank % 2 == 0 else tuple(recvs + sends)


def comm_plan(schedule) -> list:
    """``plan[rank][k]``: the batches (tuples of ``Msg``) that rank posts before its k-th action;
    ``k = len(actions)`` holds those posted after its last action.

    Rounds of a global clock keep the ranks in step: simulate the schedule (unit costs), give each
    message the time its producing action ends as its round, and let both ends post it in their
    batch of that round. A rank posts its batches in round order, a send after its producer (which
    ends at the round) and a receive before its consumer (which starts at the round or later). Then
    the lowest round any rank waits in is one its partners have reached too, so every batch
    completes: no deadlock, for any valid schedule. (Batching one action's sends with the next
    one's receives, Megatron's 1F1B rule, deadlocks the interleaved schedule: two ranks each send a
    gradient the other only receives after its next forward.) A shape travels one sub-round before
    its activation, whose receive buffer it sizes."""
    timeline = simulate(schedule, t_f=1.0, t_b=1.0, t_w=1.0).timeline
    end = {(a.op, a.stage, a.microbatch): e for tl in timeline for _, e, a in tl}

    def produced(m: Msg) -> float:  # when the action making this message ends
        if m.what == "gradient":
            return end.get(("B", m.boundary + 1, m.microbatch), end.get(("BW", m.boundary + 1, m.microbatch)))
        return end[("F", m.boundary, m.microbatch)]

    plan = []
    for rank, actions in enumerate(schedule.actions):
        rounds: dict = {}  # (round, sub-round) -> messages
        announced: set = set()
        for a in actions:
            for m in sum(_traffic(schedule, rank, a, announced), []):
                rounds.setdefault((produced(m), 0 if m.what == "shape" else 1), []).append(m)
        starts = [s for s, _, _ in timeline[rank]]
        points = [[] for _ in range(len(actions) + 1)]
        for key in sorted(rounds):
            k = next((i for i, s in enumerate(starts) if s >= key[0]), len(actions))
            points[k].append(_ordered(rank, sorted(rounds[key], key=lambda m: (m.peer, m.what))))
        plan.append(points)
    return plan


def _where(schedule, rank: int, k: int) -> str:
    actions = schedule.actions[rank]
    return f"before {actions[k]}" if k < len(actions) else "after its last action"


def check_comm_plan(schedule, plan) -> None:
    """Raise ``ScheduleError`` if two ranks' messages pair up wrongly (FIFO per direction) or if
    the batches deadlock when every send waits for its receiver (NCCL, large messages)."""
    p = schedule.num_ranks
    flat = [[(k, batch) for k, point in enumerate(plan[r]) for batch in point] for r in range(p)]
    # FIFO: the n-th send a -> b pairs with the n-th receive b posts from a
    seq: dict = {}  # (src, dst, send?) -> [(rank, batch index, op index, msg)]
    for r in range(p):
        for i, (_, batch) in enumerate(flat[r]):
            for j, m in enumerate(batch):
                key = (r, m.peer, True) if m.send else (m.peer, r, False)
                seq.setdefault(key, []).append((r, i, j, m))
    partner = {}
    for a in range(p):
        for b in range(p):
            sends, recvs = seq.get((a, b, True), []), seq.get((a, b, False), [])
            for n in range(max(len(sends), len(recvs))):
                if n >= len(sends) or n >= len(recvs) or sends[n][3].label != recvs[n][3].label:
                    got = f"{sends[n][3].what} {sends[n][3].boundary}->{sends[n][3].boundary + 1} microbatch " \
                          f"{sends[n][3].microbatch}" if n < len(sends) else "nothing"
                    want = str(recvs[n][3]) if n < len(recvs) else "nothing"
                    raise ScheduleError(f"P2P mismatch: message #{n} from rank {a} to rank {b} is {got}, but rank "
                                        f"{b} posts '{want}' for it (NCCL pairs messages in posting order)")
                partner[sends[n][:3]], partner[recvs[n][:3]] = recvs[n][:3], sends[n][:3]
    # replay: a rank's batches run in order; an operation completes when its partner's batch runs
    cur, matched = [0] * p, set()
    progress = True
    while progress:
        progress = False
        for r in range(p):
            while cur[r] < len(flat[r]):
                batch = flat[r][cur[r]][1]
                for j in range(len(batch)):
                    other = partner[(r, cur[r], j)]
                    if (r, cur[r], j) not in matched and cur[other[0]] == other[1]:
                        matched.update({(r, cur[r], j), other})
                if not all((r, cur[r], j) in matched for j in range(len(batch))):
                    break
                cur[r] += 1
                progress = True
    for r in range(p):
        if cur[r] < len(flat[r]):
            k, batch = flat[r][cur[r]]
            j = next(j for j in range(len(batch)) if (r, cur[r], j) not in matched)
            q, i, _ = partner[(r, cur[r], j)]
            stuck = [f"rank {s} {_where(schedule, s, flat[s][cur[s]][0])}" for s in range(p) if cur[s] < len(flat[s])]
            raise ScheduleError(f"P2P deadlock: rank {r}'s batch {_where(schedule, r, k)} waits to '{batch[j]}', "
                                f"which rank {q} posts only in its batch {_where(schedule, q, flat[q][i][0])}; "
                                f"stuck: {', '.join(stuck)}")
