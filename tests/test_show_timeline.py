"""scripts/show_timeline.py: a decode step's launch sequence cut into per-layer cycles at the
anchor kernel, with each position's median start-to-next-start time, duration and end past the ends before."""
import json

import pytest


def _launches(layers: int, choice_us: list[float]) -> list[dict]:
    """A dense layer first (no anchor), then `layers` sparse layers of scores, choice, split and two linears
    (o and down, the second launch of the same name), choice taking choice_us[i] in layer i."""
    out, t = [], 0.0
    out += [{"name": "_decode_split_kernel", "us": 30.0, "at_us": t}]
    t += 31.0
    for i in range(layers):
        for name, span in (("(anonymous namespace)::scores_kernel(qscore::Args)", 40.0),
                           ("void (anonymous namespace)::select_kernel<36, true>(qsel::Args)", choice_us[i]),
                           ("_decode_split_kernel", 16.0),
                           ("void (anonymous namespace)::linear_kernel<false, false>(Params, Rope)", 10.0),
                           ("void (anonymous namespace)::linear_kernel<false, false>(Params, Rope)", 38.0)):
            out.append({"name": name, "us": span + 1.0, "at_us": t})  # each overlaps the next by 1 us (PDL)
            t += span
    out.append({"name": "(anonymous namespace)::scores_kernel(qscore::Args)", "us": 40.0, "at_us": t})
    return out


def test_cycles_at_the_anchor(load_script):
    rows = load_script("show_timeline").layer_cycles(_launches(3, [7.0, 9.0, 8.0]), "scores_kernel")
    assert [r["kernel"] for r in rows] == ["scores", "choice", "split", "linear", "linear#2"]
    assert [r["to_next_us"] for r in rows] == [40.0, 8.0, 16.0, 10.0, 38.0]  # the choice's median over 3 layers
    assert rows[1]["us"] == 9.0 and all(r["cycles"] == 3 for r in rows)
    # each ends 1 us past the next's start: past the one before's end by its own span
    assert [r["past_end_us"] for r in rows] == [40.0, 8.0, 16.0, 10.0, 38.0]


def test_a_launch_that_ends_inside_another_adds_nothing_past_the_ends(load_script):
    launches = _launches(3, [7.0, 7.0, 7.0])
    for i, r in enumerate(launches):  # every choice ends 2 us before the scores before it do
        if "select_kernel" in r["name"]:
            r["us"] = launches[i - 1]["at_us"] + launches[i - 1]["us"] - r["at_us"] - 2.0
    rows = load_script("show_timeline").layer_cycles(launches, "scores_kernel")
    assert rows[1]["past_end_us"] == 0.0
    assert rows[2]["past_end_us"] == 16.0 + 7.0  # the split: past the scores' end, the latest before it


def test_cycles_of_another_shape_are_left_out(load_script):
    launches = _launches(3, [7.0, 7.0, 7.0])
    del launches[-3]  # the last layer without its split: only the first two cycles have the first's shape
    rows = load_script("show_timeline").layer_cycles(launches, "scores_kernel")
    assert rows[0]["cycles"] == 2 and [r["kernel"] for r in rows][2] == "split"


def test_too_few_anchors_and_the_command_line(tmp_path, capsys, load_script):
    st = load_script("show_timeline")
    assert st.layer_cycles(_launches(0, []), "scores_kernel") == []
    prof = tmp_path / "p.json"
    prof.write_text(json.dumps({"graph_step_ms": 1.5, "bandwidth_gbps": 4000.0,
                                "graph_launch_sequence": {"launches": _launches(2, [7.0, 7.0])}}))
    st.main([str(prof), "--bytes", "split=40"])
    out = capsys.readouterr().out
    assert "2 cycles; graph step 1.500 ms" in out and "10.00 us at 4000 GB/s" in out
    with pytest.raises(SystemExit, match="fewer than two launches match 'nothing'"):
        st.main([str(prof), "--anchor", "nothing"])
