"""0/1 Adam (--optimizer adam-01): its schedule against DeepSpeed's counters, the optimizer against
a plain reference of the algorithm written here (DP1; DP2 with the reference simulating both
ranks and the sign codec), AdamW bit for bit before the first compressed step, the bytes of each
kind of step, checkpoints that resume exactly and reshard to DP1."""
import math

import pytest
import torch

from megatron_lite.optim.zero_one_adam import local_interval, variance_schedule
from megatron_lite.testing import run_distributed
from test_compression import _resumed_exactly_and_saved, _train_with_params
from training_utils import TINY

# variance steps 1, 2 (AdamW exactly), 4, 6; 1-bit gradients at 3, 5, 7; local steps from 8,
# synchronised at 8, 9, 10, 12, 16 (the interval 1, 1, 2, 2, 4, 4, 4 (clipped), ...)
SCHEDULE = ["--optimizer", "adam-01", "--var-freeze-step", "7", "--var-update-scaler", "2",
            "--local-step-scaler", "2", "--local-step-clipper", "4"]
RUN = TINY + ["--train-iters", "16", "--log-comm-volume"] + SCHEDULE


def _deepspeed_counters(steps, var_update_scaler, var_freeze_step, local_step_scaler, local_step_clipper):
    """Per step 1..steps: (variance step, variance steps so far, synchronising local step), by
    DeepSpeed's counters (var_interval / var_counter, local_step_interval / local_step_counter)."""
    var_interval, var_counter, updates, interval, counter, out = 1, 0, 0, 1, 0, []
    for t in range(1, steps + 1):
        if t <= var_freeze_step:
            variance = t % var_interval == 0
            updates += variance
            out.append((variance, updates, False))
            if variance:
                var_counter += 1
                if var_counter == var_update_scaler:
                    var_counter, var_interval = 0, var_interval * 2
            continue
        out.append((False, updates, t % interval == 0))
        counter += 1
        if counter == local_step_scaler:
            counter, interval = 0, min(local_step_clipper, interval * 2)
    return out


@pytest.mark.parametrize("scalers", [(16, 32678, 16), (2, 2, 4), (3, 1, 5), (1, 3, 1)])
def test_schedule_is_deepspeeds(scalers):
    k, s, h = scalers
    for freeze in (7, 100):
        want = _deepspeed_counters(400, k, freeze, s, h)
        got = [(t <= freeze and variance_schedule(t, k)[0], variance_schedule(min(t, freeze), k)[1],
                t > freeze and t % local_interval(t, freeze, s, h) == 0) for t in range(1, 401)]
        assert got == want


def _recorded(rank, world, argv):
    """Train `argv`, recording what the rule gets at each step (its gradient, LR, weight decay, the
    decayed ranges) and the main params before the first and after every step, per bucket."""
    import os
    os.environ["WORLD_SIZE"] = str(world)
    from pretrain_gpt import make_trainer, resolve
    trainer = make_trainer(*resolve(argv), torch.device("cpu"))
    rule, steps = trainer.optimizer.rule, []
    update = rule.update_shard_

    def recording(s, grad, lr_of, weight_decay, step):
        main = s.store.tensors["main"]
        rec = dict(step=step, bucket=s.bucket.index, grad=grad.clone(), lr=lr_of("default"), wd=weight_decay,
                   decay=list(s.decay), offsets=list(s.bucket.offsets), before=main.clone(), ranks=s.bucket.group_size,
                   m=s.store.tensors["exp_avg"].clone(), v=s.store.tensors["exp_avg_sq"].clone())
        update(s, grad, lr_of, weight_decay, step)
        steps.append(dict(rec, after=main.clone()))
    rule.update_shard_ = recording
    history = trainer.train()
    return history, steps


def _signs(y, owners):
    """Each row of y as signs times one scale per tensor in the row, the RMS of the row's elements
    of that tensor (owners: the tensor of each element, -1 for padding, sent as 0)."""
    out = torch.zeros_like(y)
    for r in range(y.shape[0]):
        for i in owners[r].unique().tolist():
            if i >= 0:
                mine = owners[r] == i
                scale = y[r][mine].norm() / math.sqrt(mine.sum())
                out[r][mine] = torch.where(y[r][mine] >= 0, scale, -scale)
    return out


def _compressed_mean(xs, worker, server, dead, offsets):
    """The mean over ranks of xs through DeepSpeed's compressed all-reduce, with DeepSpeed's one
    scale per tensor (`offsets`: each one's [lo, hi) in the bucket): each rank's tensor + its worker
    error cut into N rows (padded to bytes of signs), every row as signs with a scale per tensor in
    it to the row's owner, which sums them, adds its server error and sends that back the same
    way; no error kept where `dead` (or in the padding)."""
    ranks, numel = len(xs), xs[0].numel()
    shard = -(-numel // ranks)
    width = -(-shard // 8) * 8

    def rows(x, fill=0.0):
        out = torch.full((ranks, width), fill)
        out[:, :shard] = torch.cat([x, torch.full((ranks * shard - numel,), fill)]).view(ranks, shard)
        return out
    owners = torch.full((numel,), -1.0)
    for i, (lo, hi) in enumerate(offsets):
        owners[lo:hi] = i
    owners = rows(owners, -1.0).long()
    live = rows((~dead).float()) != 0
    sums = torch.zeros(ranks, width)
    for r, x in enumerate(xs):
        y = rows(x) + worker[r]
        sent = _signs(y, owners)
        worker[r] = (y - sent) * live
        sums += sent
    out = torch.zeros(ranks, width)
    for j in range(ranks):
        z = sums[j] + server[j]
        out[j] = _signs(z.view(1, width), owners[j:j + 1]).view(-1)
        server[j] = (z - out[j]) * live[j]
    return out[:, :shard].reshape(-1)[:numel] / ranks


def _reference(per_rank, argv_schedule, start, beta1=0.9, beta2=0.999, eps=1e-8):
    """0/1 Adam on the recorded gradients of every rank (lists of one bucket's records by step),
    from the recorded params, m and v before step `start` (the steps before: AdamW's fused kernel,
    checked apart): each rank's params after each step from `start` on. (The same expressions as
    the optimizer's, so that the same bits go into the sign codec: a value near 0 rounded the
    other way would flip its sign.)"""
    freeze, k, s, h = (int(argv_schedule[argv_schedule.index(f) + 1]) for f in
                       ("--var-freeze-step", "--var-update-scaler", "--local-step-scaler", "--local-step-clipper"))
    counters = _deepspeed_counters(len(per_rank[0]), k, freeze, s, h)[start - 1:]
    per_rank = [recs[start - 1:] for recs in per_rank]
    ranks, first = len(per_rank), per_rank[0][0]
    offsets = first["offsets"]
    n = first["before"].numel()
    decayed = torch.zeros(n, dtype=torch.bool)
    for lo, hi in first["decay"]:
        decayed[lo:hi] = True
    p = [recs[0]["before"].clone() for recs in per_rank]
    m, v = [recs[0]["m"].clone() for recs in per_rank], first["v"].clone()
    shard = -(-n // ranks)
    width = -(-shard // 8) * 8
    worker, server = [torch.zeros(ranks, width) for _ in p], torch.zeros(ranks, width)
    anchor, lrs, out = None, 0.0, []
    for i, (variance, updates, sync) in enumerate(counters):
        t, lr, wd = per_rank[0][i]["step"], per_rank[0][i]["lr"], per_rank[0][i]["wd"]
        grads = [recs[i]["grad"] * ranks for recs in per_rank]  # (each rank's estimate of the whole)
        dead = v == 0
        denom = v.sqrt() / math.sqrt(1 - beta2 ** updates) + eps
        if variance:  # the fp32 all-reduced gradient: every rank's the same
            g = per_rank[0][i]["grad"]
            m = [torch.lerp(mr, g, 1 - beta1) for mr in m]
            v = torch.addcmul(v * beta2, g, g, value=1 - beta2)
        elif t <= freeze:
            xs = [torch.where(dead, 0.0, g / denom) for g in grads]  # (sent as the update it makes)
            g = (_compressed_mean(xs, worker, server, dead, offsets) if ranks > 1 else xs[0]) * denom
            m = [torch.where(dead, 0.0, torch.lerp(mr, g, 1 - beta1)) for mr in m]
        else:
            if t == freeze + 1:
                anchor = p[0].clone()
                worker, server = [torch.zeros_like(w) for w in worker], torch.zeros_like(server)
            m = [torch.where(dead, 0.0, torch.lerp(mr, g, 1 - beta1)) for mr, g in zip(m, grads)]
        denom = v.sqrt() / math.sqrt(1 - beta2 ** updates) + eps  # (v may have changed)
        p = [torch.where(decayed, pr * (1 - lr * wd), pr) for pr in p]
        p = [torch.addcdiv(pr, mr, denom, value=-lr / (1 - beta1 ** t)) for pr, mr in zip(p, m)]
        if t > freeze:
            anchor, lrs = torch.where(decayed, anchor * (1 - lr * wd), anchor), lrs + lr
            if sync:
                moves = [anchor - pr for pr in p]
                moved = torch.where(dead, 0.0, _compressed_mean(moves, worker, server, dead, offsets) if ranks > 1 else moves[0])
                anchor = anchor - moved
                p = [anchor.clone() for _ in p]
                m = [moved * denom * ((1 - beta1 ** t) / lrs) for _ in m]
                lrs = 0.0
        out.append([pr.clone() for pr in p])
    return out


def _check_against_reference(runs):
    per_rank = [steps for _, steps in runs]
    assert {rec["bucket"] for rec in per_rank[0]} == {0}, "one bucket expected"
    want = _reference(per_rank, SCHEDULE, start=3)
    for r, steps in enumerate(per_rank):
        for rec, ref in zip(steps[2:], want):
            torch.testing.assert_close(rec["after"], ref[r], rtol=0, atol=1e-6, msg=f"rank {r} step {rec['step']}")


def test_one_rank_equals_the_reference():
    """DP1 (nothing compressed, as DeepSpeed's): 16 steps crossing variance intervals, 1-bit steps
    (exact at one rank), the freeze and local steps with resets of the momentum at T_u."""
    _check_against_reference(run_distributed(_recorded, 1, RUN, timeout=240))


def test_two_ranks_equal_the_reference_and_move_the_bytes_of_each_step():
    """DP2: every rank's params after every step equal the reference's simulation of both ranks
    with the sign codec to 1e-6; the first two steps are AdamW's bit for bit; bytes per step: the
    fp32 all-reduce of P at variance steps, signs both ways (N rows of P / 8N bytes plus 4-byte
    scales, as many per row as the most tensors a row meets, twice) at 1-bit and synchronising steps, nothing at local steps between; the
    replicas agree bit for bit after each synchronisation; a step on local gradients clips (and
    reports) the norm of the ranks' estimates of the whole, N_dp x their parts (their RMS)."""
    runs = run_distributed(_recorded, 2, RUN, timeout=240)
    _check_against_reference(runs)
    for a, b in zip(runs[0][1], runs[1][1]):
        if a["step"] in (8, 9, 10, 12, 16) or a["step"] <= 7:
            assert torch.equal(a["after"], b["after"]), a["step"]
    assert not torch.equal(runs[0][1][10]["after"], runs[1][1][10]["after"])  # (step 11: local)
    two = TINY + ["--train-iters", "2"]
    adam, zero_one = (run_distributed(_train_with_params, 2, argv, timeout=240)[0][1] for argv in (two, two + SCHEDULE))
    assert all(torch.equal(zero_one[k], adam[k]) for k in adam)
    for k, rec in enumerate(runs[0][0]):  # clipped to --clip-grad 1: local estimates as the global gradient
        step = k + 1
        estimates = [steps[k]["grad"].double() * (1 if step in (1, 2, 4, 6) else 2) for _, steps in runs]
        rms = (sum(e.norm() ** 2 for e in estimates) / 2).sqrt().item()
        assert rms == pytest.approx(rec["grad_norm"] * min(1.0, 1.0 / (rec["grad_norm"] + 1e-6)), rel=1e-5), step
    psi, ranks = runs[0][1][0]["before"].numel(), 2
    shard = -(-psi // ranks)
    tensors_per_row = max(sum(max(lo, r * shard) < min(hi, (r + 1) * shard) for lo, hi in runs[0][1][0]["offsets"])
                          for r in range(ranks))
    signs = ranks * (-(-shard // 8) + 4 * tensors_per_row)
    kinds = {1: "variance", 2: "variance", 4: "variance", 6: "variance", 3: "signs", 5: "signs", 7: "signs",
             8: "signs", 9: "signs", 10: "signs", 12: "signs", 16: "signs"}
    comm = [rec["comm_bytes"] for rec in runs[0][0]]
    local_all_reduce = comm[10]["all_reduce"]  # (step 11: the loss and norm reductions only)
    for step, c in enumerate(comm, 1):
        kind = kinds.get(step, "local")
        assert c["all_reduce"] - local_all_reduce == (4 * psi if kind == "variance" else 0), step
        sent = signs if kind == "signs" else 0
        assert (c.get("all_to_all", 0), c.get("all_gather", 0)) == (sent, sent), step


ZO_CKPT = TINY + ["--train-iters", "6", "--optimizer", "adam-01", "--var-freeze-step", "3", "--var-update-scaler", "1",
                  "--local-step-scaler", "1", "--local-step-clipper", "4"]  # 1-bit at 3, syncs at 4 (5 and 6 local)


def _loaded_zero_one(rank, world, argv):
    """After a load at `world` ranks: what the next averaged tensor gets added (twice: once only)."""
    import os
    os.environ["WORLD_SIZE"] = str(world)
    from pretrain_gpt import make_trainer, resolve
    from megatron_lite.parallel.sharding import stored_name
    trainer = make_trainer(*resolve(argv), torch.device("cpu"))
    rule, out = trainer.optimizer.rule, {}
    for b in trainer.grad_sync.buckets:
        dead = torch.zeros(b.numel, dtype=torch.bool)
        added = [rule._average(b, torch.zeros(b.numel), dead) for _ in range(2)]
        for i, lo, hi in b.segments(0, b.numel):
            o = b.offsets[i][0]
            out[stored_name(b.names[i], b.params[i])] = [a[o + lo:o + hi].clone() for a in added]
    return out


def test_resumes_exactly_and_the_residual_reshards_to_one_rank(tmp_path):
    """DP2 saved at 5 (a local step not synchronised: the save synchronises) and resumed continues
    exactly as the run that saved at 5 and went on; loaded at DP1, the next averaged tensor gets
    the checkpoint's residual (the mean of the DP2 errors) added once, as a DP2 resume's next
    compressed all-reduce adds it."""
    saved = _resumed_exactly_and_saved(ZO_CKPT, 5, tmp_path, "exp_avg_residual")
    (loaded,) = run_distributed(_loaded_zero_one, 1, ZO_CKPT + ["--load", str(tmp_path / "a")], timeout=240)
    for name, want in saved.items():
        first, second = loaded[name]
        assert torch.equal(first[:want.numel()], want) and not second.any(), name


def _memory_after_training(rank, world, argv):
    import os
    os.environ["WORLD_SIZE"] = str(world)
    from pretrain_gpt import make_trainer, resolve
    trainer = make_trainer(*resolve(argv), torch.device("cpu"))
    trainer.train()
    return trainer.optimizer.memory_bytes(), trainer.optimizer.held_bytes()


def test_memory_accounting_counts_the_anchor_and_the_errors():
    """DP2, past the first compressed step and the freeze: the start-up line's figures and the
    planner's count what the optimizer holds, the anchor and the sign errors included."""
    from tests.planner_harness import predict
    accounted, held = run_distributed(_memory_after_training, 2, ZO_CKPT, timeout=240)[0]
    planned = predict(ZO_CKPT, 2, 0, 0)["accounted"]
    adam = predict(TINY, 2, 0, 0)["accounted"]["optimizer_state_bytes"]
    for key in ("optimizer_state_bytes", "error_feedback_bytes"):  # (m, v, the anchor; the sign errors)
        assert accounted[key] == held[key] == planned[key], key
    assert planned["optimizer_state_bytes"] == adam * 3 // 2  # an anchor beside Adam's m and v (fp32 params)
    assert planned["error_feedback_bytes"] >= adam * 3 // 4  # the worker's 2 half rows + the server's one

