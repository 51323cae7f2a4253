"""The demo (`make demo`): the 4-D run agrees with its single-process reference, its composition
checks fail before any rank starts, and its zero-bubble simulation uses the measured W times."""
import argparse

import pytest

from overlapkernels import demo


def test_demo_smoke(rank_pool):
    cfg = demo.DemoConfig(steps=2, reference_steps=2, batch=4, seq=8, vocab=16, hidden=16, layers=2)
    rows = rank_pool(4).run(demo.rank_main, demo.config_dict(cfg))[0]
    assert [r["step"] for r in rows] == [0, 1]
    for row in rows:  # the 4-D run and the single-process reference agree (fp32)
        assert row["loss"] == pytest.approx(row["reference"], rel=1e-5)
    assert "1-proc ref" in demo.format_rows(rows, cfg)


def test_demo_with_compiled_blocks_agrees_with_its_reference(rank_pool):
    """--compile: the 4-D run's blocks each one fullgraph torch.compile graph (aot_eager: no C++ build)."""
    cfg = demo.DemoConfig(steps=2, reference_steps=2, batch=4, seq=8, vocab=16, hidden=16, layers=2, compile="aot_eager")
    rows = rank_pool(4).run(demo.rank_main, demo.config_dict(cfg))[0]
    for row in rows:
        assert row["loss"] == pytest.approx(row["reference"], rel=1e-5)
    assert "blocks compiled (aot_eager)" in demo.format_rows(rows, cfg)


def test_demo_with_zero_3_clipping_and_recompute_agrees_with_its_reference(rank_pool):
    """dp=2 x pp=2, ZeRO-3 reducing once per step, clipped, blocks recomputed: the 4-D grad norm
    (the whole model's: every stage, every DP shard) and the loss agree with the clipped single
    process's, step for step."""
    cfg = demo.DemoConfig(tp=1, dp=2, steps=3, reference_steps=2, batch=8, seq=8, vocab=16, hidden=16, layers=2,
                          zero_stage=3, max_grad_norm=0.1, activation_checkpointing=True, reduce_per_microbatch=False)
    rows = rank_pool(4).run(demo.rank_main, demo.config_dict(cfg))[0]
    # past the reference's steps there is nothing to compare with (not the 4-D run's own figures)
    assert (rows[2]["reference"], rows[2]["reference_grad_norm"]) == (None, None) and rows[2]["grad_norm"] > 0
    for row in rows[:2]:
        assert row["reference_grad_norm"] > 0.1  # so both clipped
        assert row["grad_norm"] == pytest.approx(row["reference_grad_norm"], rel=1e-5)
        assert row["loss"] == pytest.approx(row["reference"], rel=1e-5)
    table = demo.format_rows(rows, cfg)
    assert "ZeRO-3 reduced once per step, clipped at 0.1, activation checkpointing" in table and "grad norm" in table


def test_demo_refuses_compositions_it_cannot_run_before_spawning():
    for kwargs, message in ((dict(tp=3, pp=1), r"tp=3 must divide the 2 KV heads"),
                            (dict(schedule="interleaved-1f1b", layers=6), r"layers=6 must be divisible by pp=2 x 2 "
                                                                          r"chunks per rank"),
                            (dict(zero_stage=4), r"zero_stage=4: expected 1, 2 or 3"),
                            (dict(zero_stage=1.0), r"zero_stage=1\.0: expected 1, 2 or 3"),
                            (dict(zero_stage=True), r"zero_stage=True: expected 1, 2 or 3"),
                            (dict(max_grad_norm=0.0), r"max_grad_norm=0\.0: expected a finite number > 0"),
                            (dict(max_grad_norm=True), r"max_grad_norm=True: expected a finite number > 0"),
                            (dict(max_grad_norm="1"), r"max_grad_norm='1': expected a finite number > 0"),
                            (dict(activation_checkpointing=1), r"activation_checkpointing=1: expected a bool"),
                            (dict(reduce_per_microbatch=0), r"reduce_per_microbatch=0: expected a bool"),
                            (dict(batch=6), r"batch=6 must be divisible by dp x microbatches = 1 x 4"),
                            (dict(compile="inductor", schedule="zb-v"), r"compile='inductor' with schedule='zb-v'"),
                            (dict(compile=True), r"compile=True: expected a torch.compile backend name")):
        with pytest.raises(ValueError, match=message):
            demo.DemoConfig(**kwargs).resolved(3 if kwargs.get("tp") == 3 else 4)


def test_demo_data_parallel_size_defaults_to_the_ranks_left():
    """`overlapkernels demo --tp 1 --pp 2` on its default 4 ranks runs dp=2 (with dp=1 it refused:
    1 x 2 x 1 x 1 != 4); an explicit --dp that does not fit is still refused before any rank starts."""
    parser = demo.add_arguments(argparse.ArgumentParser(), 4)
    for argv, dp in ((["--tp", "1", "--pp", "2"], 2), ([], 1), (["--tp", "1", "--pp", "1"], 4)):
        assert demo.config_from_args(parser.parse_args(argv)).resolved(4).dp == dp
    with pytest.raises(ValueError, match="world size 4"):
        demo.config_from_args(parser.parse_args(["--tp", "1", "--pp", "2", "--dp", "1"])).resolved(4)


def test_demo_interleaved_runs_two_chunks_per_rank(rank_pool):
    """interleaved-1f1b (it ran as 1F1B with one chunk per rank, so the demo refused it): two chunks
    per rank, the loss agrees with the reference, and the simulated bubble is the interleaved one."""
    from overlapkernels.runtime import pipeline as pp

    cfg = demo.DemoConfig(tp=1, pp=2, steps=1, reference_steps=1, batch=4, seq=8, vocab=16, hidden=16, layers=4,
                          schedule="interleaved-1f1b")
    (row,) = rank_pool(2).run(demo.rank_main, demo.config_dict(cfg))[0]
    assert row["loss"] == pytest.approx(row["reference"], rel=1e-5)
    interleaved = pp.make_schedule("interleaved-1f1b", 2, 4, num_virtual=2)
    assert row["bubble_simulated"] == pp.simulate(interleaved, t_f=row["t_f"], t_b=row["t_b"]).bubble_fraction


def test_demo_zb_v_runs_two_chunks_per_rank_in_a_v(rank_pool):
    """zb-v: two chunks per rank (layers must split over 2 x pp), the loss agrees with the
    reference, the table says so, and the simulation is zb-v's with the measured F, B and W."""
    from overlapkernels.runtime import pipeline as pp

    with pytest.raises(ValueError, match=r"layers=2 must be divisible by pp=2 x 2 chunks per rank"):
        demo.DemoConfig(tp=1, pp=2, layers=2, schedule="zb-v").resolved(2)
    cfg = demo.DemoConfig(tp=1, pp=2, steps=1, reference_steps=1, batch=4, seq=8, vocab=16, hidden=16, layers=4,
                          schedule="zb-v")
    (row,) = rank_pool(2).run(demo.rank_main, demo.config_dict(cfg))[0]
    assert row["loss"] == pytest.approx(row["reference"], rel=1e-5) and row["t_w"] > 0, row
    zbv = pp.make_schedule("zb-v", 2, 4)
    assert row["bubble_simulated"] == pp.simulate(zbv, t_f=row["t_f"], t_b=row["t_b"], t_w=row["t_w"]).bubble_fraction
    assert "zb-v (2 chunks per rank)" in demo.format_rows([row], cfg)


def test_demo_zero_bubble_simulation_uses_the_measured_weight_gradients(rank_pool):
    """Without W's time the simulator gives zb-h1 1F1B's bubble, (p-1)/(m+p-1) = 1/5 here: the row's
    figure must be the simulation of the measured per-microbatch F, B and W times, W included."""
    from overlapkernels.runtime import pipeline as pp

    cfg = demo.DemoConfig(tp=1, pp=2, steps=1, reference_steps=1, batch=4, seq=8, vocab=16, hidden=16, layers=2,
                          schedule="zb-h1")
    (row,) = rank_pool(2).run(demo.rank_main, demo.config_dict(cfg))[0]
    assert row["loss"] == pytest.approx(row["reference"], rel=1e-5)
    assert row["t_w"] > 0, row
    zb = pp.make_schedule("zb-h1", 2, 4)
    assert row["bubble_simulated"] == pp.simulate(zb, t_f=row["t_f"], t_b=row["t_b"], t_w=row["t_w"]).bubble_fraction
    assert row["bubble_simulated"] != pp.simulate(zb, t_f=row["t_f"], t_b=row["t_b"]).bubble_fraction


@pytest.mark.parametrize("dtype, rel", [("bfloat16", 3e-2), ("float16", 5e-3)])
def test_demo_trains_16_bit_weights_close_to_its_fp32_reference(rank_pool, dtype, rel):
    """--dtype: 16-bit weights with fp32 masters and reductions (float16 with loss scaling) follow
    the fp32 reference to their precision, and the table says what ran; a planted fp32 run would
    agree to 1e-5 (the smoke test), so the tolerance here only admits the 16-bit rounding."""
    cfg = demo.DemoConfig(tp=1, pp=2, steps=2, reference_steps=2, batch=4, seq=8, vocab=16, hidden=16, layers=2,
                          dtype=dtype)
    rows = rank_pool(2).run(demo.rank_main, demo.config_dict(cfg))[0]
    for row in rows:
        assert row["loss"] == pytest.approx(row["reference"], rel=rel) and not row["skipped"], row
    assert any(abs(row["loss"] - row["reference"]) > 1e-6 * abs(row["reference"]) for row in rows), rows  # 16 bits ran
    table = demo.format_rows(rows, cfg)
    assert f"{dtype} (fp32 masters and reductions" in table and "CPU ranks (gloo)" in table
    with pytest.raises(ValueError, match=r"dtype='float64': expected one of float32, bfloat16, float16"):
        demo.DemoConfig(dtype="float64").resolved(4)


def test_demo_options_reach_its_configuration():
    parser = demo.add_arguments(argparse.ArgumentParser(), 4)
    cfg = demo.config_from_args(parser.parse_args(["--tp", "1", "--pp", "2", "--cp", "2", "--dp", "1", "--steps", "5",
                                                   "--schedule", "zb-h1", "--zero-stage", "3", "--max-grad-norm",
                                                   "0.5", "--activation-checkpointing", "--reduce-per-step",
                                                   "--dtype", "bfloat16", "--cp-attention", "ulysses"]))
    assert cfg == demo.DemoConfig(tp=1, pp=2, cp=2, dp=1, steps=5, schedule="zb-h1", zero_stage=3, max_grad_norm=0.5,
                                  activation_checkpointing=True, reduce_per_microbatch=False, dtype="bfloat16",
                                  cp_attention="ulysses")
    assert demo.config_from_args(parser.parse_args(["--compile"])).compile == "inductor"
    assert demo.config_from_args(parser.parse_args(["--compile", "aot_eager"])).compile == "aot_eager"
    # the demo's 4 heads (2 key/value heads) over tp=1 x cp=8: 4 query heads do not split over 8 ranks
    with pytest.raises(ValueError, match=r"ulysses_attention: each TP rank \(4 heads / TP 1\) has 4 heads, not "
                                         r"divisible by the group size 8"):
        demo.DemoConfig(tp=1, pp=1, cp=8, seq=64, cp_attention="ulysses").resolved(8)
    assert demo.config_from_args(parser.parse_args([])) == demo.DemoConfig(dp=-1)


def test_demo_table_puts_each_figure_under_its_heading():
    cfg = demo.DemoConfig(max_grad_norm=0.5)
    row = {"step": 0, "loss": 2.5, "reference": 2.5, "grad_norm": 1.25, "reference_grad_norm": 1.5,
           "tokens_per_s": 1000.0, "bubble_measured": 0.25, "bubble_simulated": 0.2, "device": "cpu"}
    header, line = demo.format_rows([row], cfg).splitlines()[1:]
    assert header.split() == ["step", "loss", "1-proc", "ref", "grad", "norm", "1-proc", "ref", "tokens/s", "bubble",
                              "meas.", "bubble", "sim."]
    assert line.split() == ["0", "2.5000", "2.5000", "1.2500", "1.5000", "1000", "25.0%", "20.0%"]


def _demo_with_fixed_times_on_rank(config):
    """The demo with each pipeline rank's compute times replaced by known ones (rank r of the
    pipeline group: F 1 + r s, B 2 + r s, no W, a step of 4 + 2r s)."""
    import torch.distributed as dist

    from overlapkernels.runtime.pipeline.runner import PipelineRunner

    step = PipelineRunner.step

    def fixed(self, *args, **kwargs):
        out = step(self, *args, **kwargs)
        r = dist.get_rank(self.group)
        self.compute_s, self.step_s = {"F": 1.0 + r, "B": 0.0, "BW": 2.0 + r, "W": 0.0}, 4.0 + 2 * r
        return out

    PipelineRunner.step = fixed
    try:
        return demo.rank_main(config)
    finally:
        PipelineRunner.step = step


def test_demo_averages_the_measured_times_over_the_pipeline_ranks(rank_pool):
    """The measured bubble and the per-action costs fed to the simulator are the pipeline ranks'
    mean (a sum scales every cost alike, which leaves the simulated bubble unchanged)."""
    cfg = demo.DemoConfig(tp=1, dp=2, steps=1, reference_steps=1, batch=8, seq=8, vocab=16, hidden=16, layers=2)
    row, = rank_pool(4).run(_demo_with_fixed_times_on_rank, demo.config_dict(cfg))[0]
    m = 2 * 2  # microbatches: 2 x pp
    assert row["bubble_measured"] == pytest.approx(((1 - 3 / 4) + (1 - 5 / 6)) / 2, rel=1e-12)
    assert (row["t_f"], row["t_b"], row["t_w"]) == pytest.approx((1.5 / m, 2.5 / m, 0.0), rel=1e-12)
