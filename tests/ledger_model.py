"""A model-based randomized test of the feedback ledger (in-process, no server): a reference
model of the lineage rules drives the real `Ledger` with random sequences of operations, as
trainer/lifecycle.py drives it, and checks every label's fate after each
(tests/test_ledger_model.py; by hand: `python tests/ledger_model.py FIRST LAST [MIX]` runs
seeds FIRST..LAST-1 and shrinks each failure; MIX is one of `MIXES`).

Ops (each a tuple, replayable):
  ("serve", id, labelled)      request at the current version (+ commit_label if labelled)
  ("label", id)                commit_label on an unlabelled request
  ("step", [ids])              optimizer step: new version, parent = current, ids trained into it
  ("save",)                    current version saved
  ("rollback", N)              rollback to saved N as a new version (saved)
  ("reject",)                  eval gate rejects the current (unsaved step) version: copy of its parent
  ("delete", id)               DELETE /v1/feedback/{id} (label only)
  ("restart", crash, release)  stop (clean: save current; crash: lose versions after the last saved),
                               release=None | "all" | [ids], start again (resume, replay)
  ("rollback_unsaved", N)      rollback whose save fails: it serves, its fates are written at once,
                               and every later save carries it (replayed: a no-op)
  ("save_killed",)             a save carrying unsaved rollbacks lands, a kill follows: crash restart
  ("rollback_killed", N)       the rollback is saved, its ledger write lost to a kill: crash restart
  ("reapply", V)               rollback V (one that survives) applied again (a replica on the shared
                               ledger, a retried write): changes nothing

The intended rules the model states (trainer/ledger_lineage.py's docstring), in terms of
which weights hold which labels:
  - a copy (rollback, gate return) makes the live weights those of N's lineage: a label
    trained and not held is quarantined (dropped if deleted); one quarantined, released or
    dropped (deleted after it trained) and held is trained again (a deleted one never trains
    again: it only reads `trained`); a rollback's fates are applied once;
  - a restart resuming saved S as W (the versions after S lost): a label held by S's
    lineage is trained; one whose held training was in a lost version is opened again
    (released if an earlier training survives, else waiting; dropped if deleted); one a
    lost rollback had given back `trained` that S does not hold is quarantined (accepted:
    a release before that rollback is not remembered); quarantined / released / dropped /
    waiting labels S does not hold keep their fates.
"""
from __future__ import annotations

import random
import shutil
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer import ledger_lineage  # noqa: E402
from trainer.ledger import Ledger  # noqa: E402
from trainer.ledger_db import (LEDGER_FILE, ChoiceRecord, LabelRecord, RequestRecord, read_ledger,  # noqa: E402
                               release_quarantined)


class Failure(AssertionError):
    def __init__(self, kind, msg):
        super().__init__(f"[{kind}] {msg}")
        self.kind = kind


class Label:
    def __init__(self, served):
        self.served = served
        self.labelled = False
        self.deleted = False
        self.status = "unlabelled"  # waiting trained quarantined released dropped
        self.trainings: list[int] = []
        self.ever: set[int] = set()  # every training, lost ones too


class Model:
    def __init__(self):
        self.parent: dict[int, int] = {}  # every version > 0 -> the version its weights came from
        self.cur = 0
        self.highest = 0
        self.saved = {0}
        self.rollback_of: dict[int, int] = {}  # rollback version -> restored
        self.step_versions: set[int] = set()
        self.labels: dict[str, Label] = {}
        self.pending: list[tuple[int, int]] = []
        # saved version -> the unsaved rollbacks its save carried (replayed at restart)
        self.carried: dict[int, list] = {}

    def lineage(self, v):
        out = set()
        while True:
            out.add(v)
            if v == 0 or v not in self.parent:
                return out
            v = self.parent[v]

    def held(self, lab, v):
        return set(lab.trainings) & self.lineage(v)


# how often each rule was exercised (printed by a run by hand)
COVER: dict[str, int] = {}
# "heavy": weighted towards rollbacks, deletions and restarts; "unsaved": more rollbacks whose
# save fails, and crashes
MIXES = ("plain", "heavy", "unsaved")


def cover(key):
    COVER[key] = COVER.get(key, 0) + 1


class Runner:
    def __init__(self, root: Path, verbose=False):
        self.root = root
        self.path = root / LEDGER_FILE
        self.m = Model()
        self.ledger = Ledger(self.path)
        self.ledger.resumed(-1, 0)  # fresh start: version 0 saved
        self.last_highest = -1
        self.verbose = verbose
        self.doubts: list[str] = []

    def close(self):
        self.ledger.close()

    # ---- ledger reads
    def rows(self):
        self.ledger.flush()
        return {r.request.id: r for r in read_ledger(self.path)}

    def trainable(self):
        return sorted(i for i, r in self.rows().items() if r.fate is None and r.label is not None)

    # ---- ops
    def apply(self, op):
        m, kind = self.m, op[0]
        if kind == "serve":
            _, rid, labelled = op
            if rid in m.labels:
                return False
            self.ledger.record_request(RequestRecord(rid, time.time(), m.cur, "dpo", [1, 2, 3]))
            self.ledger.record_finished(rid, [ChoiceRecord(0, [4], "x")], False)
            lab = m.labels[rid] = Label(m.cur)
            if labelled:
                self.ledger.commit_label(rid, LabelRecord("preference", chosen="a", rejected="b"))
                lab.labelled, lab.status = True, "waiting"
            return True
        if kind == "label":
            lab = m.labels.get(op[1])
            if lab is None or lab.labelled or lab.deleted:
                return False
            self.ledger.commit_label(op[1], LabelRecord("preference", chosen="a", rejected="b"))
            lab.labelled, lab.status = True, "waiting"
            return True
        if kind == "step":
            ready = set(self.trainable())
            ids = [i for i in op[1] if i in ready]
            if not ids:
                return False
            v = m.highest + 1
            for i in ids:
                lab = m.labels[i]
                if m.held(lab, m.cur):
                    raise Failure("double-training", f"{i} waits to train (ledger fate NULL) but the current "
                                  f"weights v{m.cur} hold its training(s) {sorted(m.held(lab, m.cur))}")
                if lab.status not in ("waiting", "released"):
                    raise Failure("trains-when-it-should-not", f"{i}: ledger lets it train, model state {lab.status}")
                self.ledger.record_fate(i, "trained", v)
                cover(f"step: {lab.status}->trained" + (" (again)" if lab.trainings else ""))
                lab.trainings.append(v)
                lab.ever.add(v)
                lab.status = "trained"
            m.parent[v] = m.cur
            m.step_versions.add(v)
            m.cur = m.highest = v
            return True
        if kind == "save":
            if m.cur in m.saved:
                return False
            self._save(m.cur)
            return True
        if kind == "rollback":
            n = op[1]
            if n not in m.saved:
                return False
            v = m.highest + 1
            for pn, pv in m.pending:  # its save carries the earlier unsaved ones: applied again (no-op)
                self.ledger.rolled_back(pn, pv)
            if m.pending:
                m.carried[m.highest + 1] = list(m.pending)
            m.pending = []
            self.ledger.rolled_back(n, v)
            m.parent[v] = n
            m.rollback_of[v] = n
            m.cur = m.highest = v
            m.saved.add(v)
            self.ledger.saved(v)
            self._settle_after_copy()
            return True
        if kind == "rollback_unsaved":
            n = op[1]
            if n not in m.saved:
                return False
            v = self._copy_of(n)
            m.pending.append((n, v))
            self.ledger.rolled_back(n, v)  # its fates at once (AdapterLifecycle._rollback_saved, saved=False)
            self._settle_after_copy()
            return True
        if kind == "save_killed":
            # a save that carries unsaved rollbacks lands, and a kill comes before their fates do
            if not m.pending or m.cur in m.saved:
                return False
            m.saved.add(m.cur)
            m.carried[m.cur] = list(m.pending)
            self.ledger.saved(m.cur)
            m.pending = []
            cover("save_killed")
            return self._restart(True, None)
        if kind == "rollback_killed":
            # the rollback is saved, its ledger write lost to a kill right after: crash, restart
            n = op[1]
            if n not in m.saved:
                return False
            v = self._copy_of(n)
            m.saved.add(v)
            if m.pending:  # its save carries the unsaved ones (their fates written already)
                m.carried[v] = list(m.pending)
            m.pending = []
            self.ledger.saved(v)
            # the ledger never heard of v: the restart's known comes from the store (saved v)
            self._settle_after_copy()
            return self._restart(True, None, killed_rollback=True)
        if kind == "reapply":
            # another replica on the shared ledger / a retried write applies a rollback again, whatever
            # happened since (steps, deletions, later rollbacks): nothing changes
            v = op[1] if len(op) > 1 else None
            if v is None:  # (the old form: the latest rollback)
                v = m.cur
                while v not in m.rollback_of:
                    if v not in m.step_versions:
                        return False
                    v = m.parent[v]
            if v not in m.rollback_of:
                return False
            self.ledger.rolled_back(m.rollback_of[v], v)
            cover("reapply" + (" latest" if v == m.cur else " older"))
            return True
        if kind == "reject":
            save_it = op[1] if len(op) > 1 else True
            c = m.cur
            if c not in m.step_versions or c in m.saved:
                return False
            p = m.parent[c]
            v = m.highest + 1
            ids = sorted(i for i, lab in m.labels.items() if c in lab.trainings)
            self.ledger.quarantine(ids, f"eval gate rejected version {c}", v, p)
            m.parent[v] = p
            m.cur = m.highest = v
            for i in ids:
                lab = m.labels[i]
                if lab.status == "trained":
                    lab.status = "dropped" if lab.deleted else "quarantined"
                    cover("reject: ->" + lab.status)
            if save_it:
                self._save(v)
            return True
        if kind == "delete":
            lab = m.labels.get(op[1])
            if lab is None or not lab.labelled or lab.deleted:
                return False
            held = m.held(lab, m.cur)
            d = self.ledger.delete(op[1], label_only=True)
            if not d.found:
                raise Failure("delete", f"{op[1]} not found")
            want = (min(held) if held else None) if lab.status == "trained" else None
            if d.trained_into != want:
                raise Failure("delete-trained_into", f"{op[1]}: trained_into {d.trained_into}, expected {want} "
                              f"(model {lab.status}, trainings {lab.trainings}, lineage holds {sorted(held)})")
            cover("delete " + lab.status)
            lab.deleted = True
            if lab.status in ("waiting", "released", "quarantined"):
                lab.status = "dropped"
            return True
        if kind == "restart":
            _, crash, release = op
            return self._restart(crash, release)
        raise ValueError(op)

    def _save(self, v):
        m = self.m
        m.saved.add(v)
        if m.pending:
            m.carried[v] = list(m.pending)
        for n, rv in m.pending:  # their fates were written when their saves failed: applied again, no-op
            self.ledger.rolled_back(n, rv)
            cover("carried rollback applied again at save")
        m.pending = []
        self.ledger.saved(v)

    def _copy_of(self, n: int) -> int:
        """A rollback's new version, a copy of saved version `n`, now live."""
        m = self.m
        v = m.highest + 1
        m.parent[v] = n
        m.rollback_of[v] = n
        m.cur = m.highest = v
        return v

    def _settle_after_copy(self):
        """Model of a copy (rollback / gate return): weights are now lineage(cur)."""
        m = self.m
        for lab in m.labels.values():
            if not lab.labelled:
                continue
            held = m.held(lab, m.cur)
            if lab.status == "trained" and not held:
                lab.status = "dropped" if lab.deleted else "quarantined"
                cover("copy: trained->" + lab.status + (" (2+ trainings)" if len(lab.trainings) > 1 else ""))
            elif lab.status in ("quarantined", "released") and held and not lab.deleted:
                cover("copy: " + lab.status + "->trained" + (" (2+ trainings)" if len(lab.trainings) > 1 else ""))
                lab.status = "trained"
            elif lab.status == "dropped" and held:  # deleted after it trained: in the weights again, reads
                cover("copy: dropped(deleted) held again -> trained")  # trained (never trains again)
                lab.status = "trained"

    def _restart(self, crash, release, killed_rollback=False):
        m = self.m
        if not crash:
            self._save(m.cur)
        m.pending = []  # a crash loses them with their versions (their fates are written: the resume moves them)
        self.ledger.close()
        s = max(m.saved)
        # release while stopped
        if release is not None:
            ids = None if release == "all" else list(release)
            got = sorted(release_quarantined(self.path, ids))
            want = sorted(i for i, lab in m.labels.items() if lab.status == "quarantined" and not lab.deleted
                          and (ids is None or i in ids))
            if got != want:
                raise Failure("release", f"released {got}, expected {want}")
            for i in want:
                m.labels[i].status = "released"
        self.ledger = Ledger(self.path)
        known = ledger_lineage.highest_version(self.path)
        if killed_rollback:
            known = max(known, m.highest)  # (the rollback's own number: the store holds it saved)
        old_highest, old_cur = m.highest, m.cur
        if max(known, 0) != m.highest and not (m.highest == s and known <= s):
            raise Failure("highest-at-restart", f"ledger knows {known}, model highest {m.highest}")
        v = max(s, 0) if known <= s else known + 1
        # the training each label's fate names in the weights before the stop (before the lost are forgotten)
        before = {rid: m.held(lab, old_cur) for rid, lab in m.labels.items()}
        before_q = {rid: max(lab.trainings) for rid, lab in m.labels.items() if lab.status == "quarantined"
                    and lab.trainings}
        # model: versions after s die
        lost = {x for x in range(s + 1, old_highest + 1)}
        for x in lost:
            m.parent.pop(x, None)
            m.rollback_of.pop(x, None)
            m.step_versions.discard(x)
        if v != s:
            m.parent[v] = s
        m.cur = v
        m.highest = max(m.highest, v)
        # driver, as AdapterLifecycle.resume: the saved snapshot's carried rollbacks, then its own, applied
        # again (no-ops unless the ledger lost them), THEN checkpointer.resumed -> Ledger.resumed(s, v)
        for n, rv in m.carried.get(s, []):
            self.ledger.rolled_back(n, rv)
            cover("restart re-applies carried rollback")
        if s in m.rollback_of:
            self.ledger.rolled_back(m.rollback_of[s], s)
            cover("restart re-applies own rollback")
        self.ledger.resumed(s, v)
        # model: the fates follow s's weights
        for rid, lab in m.labels.items():
            lab.trainings = [t for t in lab.trainings if t not in lost]
            if not lab.labelled:
                continue
            held = m.held(lab, v)
            if held:
                if lab.status in ("quarantined", "released", "dropped"):
                    cover(f"resume: {lab.status} held by saved -> trained")
                    lab.status = "trained"
                continue
            if lab.status == "quarantined" and before_q.get(rid) in lost:
                # a lost rollback (or the gate's lost return) quarantined a training the crash lost too:
                # it stays quarantined (as a rollback to s would leave it), not opened again
                cover("resume: quarantined, its training lost too: stays quarantined")
                self.doubts.append(f"quarantined-training-lost-stays-quarantined: {rid} (training "
                                   f"v{before_q[rid]}, resumed saved v{s} as v{v})")
            if lab.status != "trained":
                continue
            if before[rid] & lost:  # its training died with the crash: opened again (trainer/replay.py)
                cover("crash lost training: " + ("deleted" if lab.deleted else "earlier survives"
                                                 if lab.trainings else "none left"))
                lab.status = "dropped" if lab.deleted else "released" if lab.trainings else "waiting"
            else:  # a lost rollback gave it back `trained`; saved's weights do not hold it
                cover("resume: given back by a lost rollback -> " + ("dropped" if lab.deleted else "quarantined"))
                lab.status = "dropped" if lab.deleted else "quarantined"
        # replay (trainer/replay.py), ledger writes only
        self.ledger.flush()
        rows = read_ledger(self.path, "r.method = ? AND (r.fate IS NULL OR (r.fate = 'trained' AND "
                                      "r.fate_version > ?))", ("dpo", s))
        lostrows = [r.request.id for r in rows if r.fate == "trained"]
        if lostrows:
            self.ledger.reopen(lostrows)
        for r in rows:
            if r.label is None and r.fate == "trained":
                lab = m.labels[r.request.id]
                if lab.labelled:  # deleted label
                    self.ledger.record_fate(r.request.id, "dropped", reason="deleted")
        return True

    # ---- checks
    def check(self):
        m = self.m
        rows = self.rows()
        hv = ledger_lineage.highest_version(self.path)
        if hv < self.last_highest:
            raise Failure("highest-decreased", f"{self.last_highest} -> {hv}")
        self.last_highest = hv
        if max(hv, 0) != m.highest:
            raise Failure("highest", f"ledger highest_version {hv}, model {m.highest}")
        # lineage as the ledger computes it
        conn = sqlite3.connect(self.path)
        try:
            ranges = ledger_lineage.lineage(conn, m.cur)
            earlier = {}
            for rid, ver in conn.execute("SELECT request_id, version FROM earlier_trainings"):
                earlier.setdefault(rid, set()).add(ver)
        finally:
            conn.close()
        known = {x for x in range(0, m.highest + 1)}
        want_lin = m.lineage(m.cur)
        got_lin = {x for x in known if any(a <= x <= b for a, b in ranges)}
        if got_lin != want_lin:
            raise Failure("lineage", f"lineage(v{m.cur}) ledger {sorted(got_lin)} model {sorted(want_lin)}")
        for rid, lab in m.labels.items():
            r = rows.get(rid)
            if r is None:
                raise Failure("row-missing", rid)
            fate, fv, reason = r.fate, r.fate_version, r.fate_reason
            held = m.held(lab, m.cur)
            desc = (f"{rid}: ledger ({fate}, v{fv}, {reason!r}); model {lab.status} trainings {lab.trainings} "
                    f"(ever {sorted(lab.ever)}) deleted={lab.deleted} cur=v{m.cur} lineage holds {sorted(held)}")
            # model self-consistency: trained <=> held (deleted aside)
            for v in list(m.parent) + [0]:
                if len(m.held(lab, v)) > 1:
                    raise Failure("twice-in-lineage", f"{rid}: v{v}'s lineage holds trainings "
                                  f"{sorted(m.held(lab, v))}")
            st = lab.status
            if st == "unlabelled":
                ok = fate is None
            elif st == "waiting":
                ok = fate is None and reason is None
                if not ok and fate is None and reason == "released" and fv in lab.ever and fv not in lab.trainings:
                    # (doubt_reopen_lost_training_released.py: reopened as released, naming a lost version;
                    # it trains all the same, and no lineage can hold that number)
                    self.doubts.append("reopen-released-names-lost-version: " + desc)
                    ok = True
            elif st == "released":
                ok = fate is None and reason == "released" and fv in lab.ever
            elif st == "trained":
                ok = fate == "trained" and fv in held
            elif st == "quarantined":
                ok = fate == "quarantined" and fv in lab.ever
            elif st == "dropped":
                ok = fate == "dropped" and reason == "deleted"
                if held and ok is False and fate == "trained" and fv in held:
                    self.doubts.append(desc)
                    ok = True
            else:
                ok = False
            if not ok:
                raise Failure(f"fate:{st}->{fate}", desc)
            if st == "trained" and not held:
                raise Failure("model", desc)
            if st != "trained" and held and lab.labelled:
                raise Failure("model-held-not-trained", desc)
            if st == "dropped" and held:
                self.doubts.append("dropped but held: " + desc)
            # the ledger's trainings (fate_version + earlier_trainings) vs the model's surviving ones
            if st in ("trained",):
                ledger_tr = set(earlier.get(rid, set())) | {fv}
                if not set(lab.trainings) <= ledger_tr | set():
                    missing = set(lab.trainings) - ledger_tr
                    # a training the ledger forgot matters only if some later rollback could restore it
                    self.doubts.append(f"ledger forgot trainings {sorted(missing)}: " + desc)


def generate(rng: random.Random, n_ops: int, root: Path, verbose=False, mix: str = "plain"):
    """Random ops generated against the live model; returns (ops, failure or None, doubts)."""
    r = Runner(root, verbose)
    ops, nid = [], 0
    try:
        for _ in range(n_ops):
            m = r.m
            choice = rng.random()
            if mix == "heavy":
                choice = choice ** 0.6 if len(m.labels) > 3 else choice
            op = None
            if mix == "unsaved" and rng.random() < 0.15:
                op = (("rollback_unsaved", rng.choice(sorted(m.saved))) if rng.random() < 0.6 else
                      ("restart", True, "all" if rng.random() < 0.5 else None))
            elif choice < 0.22:
                op = ("serve", f"r{nid}", rng.random() < 0.85)
                nid += 1
            elif choice < 0.25:
                un = [i for i, l in m.labels.items() if not l.labelled and not l.deleted]
                op = ("label", rng.choice(un)) if un else None
            elif choice < 0.47:
                ready = r.trainable()
                if ready:
                    op = ("step", sorted(rng.sample(ready, rng.randint(1, min(3, len(ready))))))
            elif choice < 0.55:
                op = ("save_killed",) if m.pending and rng.random() < 0.4 else ("save",)
            elif choice < 0.67:
                juicy = sorted(v for v in m.saved if any(
                    l.status in ("quarantined", "released", "dropped") and (m.lineage(v) & set(l.trainings))
                    for l in m.labels.values()))
                pool = juicy if juicy and rng.random() < 0.7 else sorted(m.saved)
                op = ("rollback", rng.choice(pool))
            elif choice < 0.69:
                op = ("rollback_unsaved", rng.choice(sorted(m.saved)))
            elif choice < 0.70:
                op = ("rollback_killed", rng.choice(sorted(m.saved)))
            elif choice < 0.72:
                op = ("reapply", rng.choice(sorted(m.rollback_of))) if m.rollback_of else None
            elif choice < 0.75:
                op = ("reject", rng.random() < 0.7)
            elif choice < 0.85:
                cand = [i for i, l in m.labels.items() if l.labelled and not l.deleted]
                op = ("delete", rng.choice(cand)) if cand else None
            else:
                crash = rng.random() < 0.6
                rel = rng.random()
                if rel < 0.5:
                    release = "all"
                elif rel < 0.7:
                    q = sorted(i for i, l in m.labels.items() if l.status == "quarantined")
                    release = sorted(rng.sample(q, rng.randint(0, len(q)))) if q else None
                else:
                    release = None
                op = ("restart", crash, release)
            if op is None:
                continue
            if r.apply(op):
                ops.append(op)
                r.check()
        return ops, None, r.doubts
    except Failure as f:
        ops.append(op)
        return ops, f, r.doubts
    finally:
        r.close()


def replay(ops, verbose=False):
    """Runs `ops`; returns the Failure or None."""
    root = Path(tempfile.mkdtemp())
    r = Runner(root, verbose)
    try:
        for op in ops:
            if r.apply(op):
                if verbose:
                    print("applied", op)
                r.check()
            elif verbose:
                print("skipped", op)
        if verbose and r.doubts:
            print("doubts:", *r.doubts, sep="\n  ")
        return None
    except Failure as f:
        return f
    finally:
        r.close()
        shutil.rmtree(root, ignore_errors=True)


def shrink(ops, kind):
    """Greedy one-op removal keeping the same failure kind."""
    changed = True
    while changed:
        changed = False
        for i in range(len(ops) - 1, -1, -1):
            cand = ops[:i] + ops[i + 1:]
            f = replay(cand)
            if f is not None and f.kind == kind:
                ops, changed = cand, True
        # simplify step id lists and release lists
        for i, op in enumerate(ops):
            if op[0] == "step" and len(op[1]) > 1:
                for j in range(len(op[1])):
                    cand = ops[:i] + [("step", op[1][:j] + op[1][j + 1:])] + ops[i + 1:]
                    f = replay(cand)
                    if f is not None and f.kind == kind:
                        ops, changed = cand, True
                        break
            if op[0] == "restart" and op[2] is not None:
                shorter = [op[2][:-1]] if isinstance(op[2], list) and op[2] else []
                for simpler in [None] + shorter:
                    cand = ops[:i] + [("restart", op[1], simpler)] + ops[i + 1:]
                    f = replay(cand)
                    if f is not None and f.kind == kind:
                        ops, changed = cand, True
                        break
    return ops


if __name__ == "__main__":
    import json
    first, last = int(sys.argv[1]), int(sys.argv[2])
    mix = sys.argv[3] if len(sys.argv) > 3 else "plain"
    found = {}
    doubts_all = {}
    for seed in range(first, last):
        rng = random.Random(seed)
        root = Path(tempfile.mkdtemp())
        ops, f, doubts = generate(rng, rng.randint(10, 40), root, mix=mix)
        shutil.rmtree(root, ignore_errors=True)
        for d in doubts:
            doubts_all.setdefault(d.split(":")[0], (seed, d))
        if f is not None:
            print(f"seed {seed}: {f}", flush=True)
            if f.kind not in found:
                small = shrink(ops, f.kind)
                again = replay(small)
                found[f.kind] = (seed, small, str(again))
                print(f"  shrunk to {len(small)} ops: {small}\n  {again}", flush=True)
    print("COVER", json.dumps(dict(sorted(COVER.items())), indent=1))
    print("SUMMARY", json.dumps({k: v for k, v in found.items()}, indent=1))
    print("DOUBTS", json.dumps(doubts_all, indent=1))
