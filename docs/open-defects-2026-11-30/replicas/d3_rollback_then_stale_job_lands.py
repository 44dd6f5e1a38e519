"""D3 (design-level): with replicas, a job computing when a rollback's round arrives is not
abandoned (as the single server does, online.py rollback -> trainer.abandon_job): the rollback
waits in the queue (sync_due is False while a job computes), the job finishes under the
weights the rollback replaces, contributes, the rollback applies, and then the job's step
lands on the restored weights, its labels recorded as trained into the version after the rollback."""
import queue, sys
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3]))
import torch
from tests.conftest import run_into_a_backward
from tests.test_training import label, make_trainer, serve
from tests.test_replicas import rounds_with
from trainer.replicated import CombinedStep, ReplicatedRollback, weights_digest

t = make_trainer(mode="dpo")
before = t.lifecycle.snapshot()          # version 0: what the operator rolls back to
# some training happened: version 1 (the weights the operator wants gone)
with torch.no_grad():
    for p in t.optimizer.params: p.add_(0.01)
t.optimizer.version = 1
undone = weights_digest(t.optimizer.params)
serve(t, "chatcmpl-r1-x"); label(t, "chatcmpl-r1-x")
sync = rounds_with(t.optimizer.params, [])
sync._inbox = queue.Queue()
t.replicas = t.trainer.replicas = sync
run_into_a_backward(t)                   # a job computes under version 1's weights
sync._results.append(ReplicatedRollback(before))   # the round carrying rank 0's rollback to version 0
print("job computing:", t.trainer.computing(), "| rollback waiting, sync_due:", t.sync_due())
while not t.trainer._job.contributed:
    t.run_slice()
contribution = sync._inbox.get_nowait()
print("job contributed its gradients, computed under weights", undone)
t.apply_synced()
print("rollback applied: version", t.optimizer.version, "weights", weights_digest(t.optimizer.params),
      "(version 0's:", weights_digest([before.weights[n] for n in before.weights]) if False else "", ")")
# the next round carries the job's gradients (every replica's summed): applied on the restored weights
sync._results.append(CombinedStep(contribution.grads, contribution.entries, contribution.finite, mine=True))
t.apply_synced()
t.ledger and t.ledger.flush()
print("then the job's step: version", t.optimizer.version, "; its label ended",
      t.cache.ended_state("chatcmpl-r1-x"), "into version", t.optimizer.version,
      "- gradients of the undone version's weights, applied after the rollback")
