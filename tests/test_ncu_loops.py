"""bench/ncu_loops.py on a hand-made Nsight Compute source page: lines go to their innermost loop, samples and
stalls are summed per loop, and a file that is not a source-page export is refused by name."""

import csv
import importlib.util
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location("ncu_loops", Path(__file__).parents[1] / "bench" / "ncu_loops.py")
ncu_loops = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ncu_loops)

HEADER = ["Address", "Source", "# Samples", "Instructions Executed", "Address Space", "stall_long_sb",
          "stall_barrier", "stall_long_sb (Not Issued)"]


def write(path, lines):
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Kernel Name", "k"])
        w.writerow(HEADER)
        for row in lines:
            w.writerow(row)


def test_lines_are_grouped_by_their_innermost_loop(tmp_path):
    # outer loop 0x00..0x50 holding an inner loop 0x10..0x30; 0x60 is outside both
    lines = [
        ["0x1000", "MOV R1, R2", "2", "10", "-", "0", "2", "0"],
        ["0x1010", "LDG.E.128 R4, [R2]", "30", "100", "Global", "27", "0", "5"],
        ["0x1020", "FFMA R5, R4, R4, R5", "5", "100", "-", "3", "0", "1"],
        ["0x1030", "@P0 BRA 0x1010", "5", "100", "-", "0", "0", "0"],
        ["0x1040", "STL [R1], R5", "8", "10", "Local", "8", "0", "0"],
        ["0x1050", "BRA 0x1000", "0", "10", "-", "0", "0", "0"],
        ["0x1060", "EXIT", "0", "1", "-", "0", "0", "0"],
    ]
    p = tmp_path / "sass.csv"
    write(p, lines)
    groups = ncu_loops.group_by_loop(*ncu_loops.read_sass_csv(str(p)))
    by = {g["loop"]: g for g in groups}
    assert set(by) == {"+10..+30", "+0..+50", "outside loops"}
    inner, outer = by["+10..+30"], by["+0..+50"]
    assert inner["lines"] == 3 and inner["LDG"] == 1 and inner["FFMA"] == 1 and inner["executed"] == 300
    assert inner["share"] == pytest.approx(40 / 50)
    assert inner["stalls"]["long_sb"] == pytest.approx(30 / 40)  # the Not-Issued column is not counted again
    assert outer["lines"] == 3 and outer["spill_lines"] == 1 and outer["share"] == pytest.approx(10 / 50)
    assert outer["stalls"]["barrier"] == pytest.approx(2 / 10)
    assert groups[0]["loop"] == "+10..+30"  # most samples first


def test_a_file_that_is_not_a_source_page_is_refused(tmp_path):
    p = tmp_path / "details.csv"
    p.write_text('"ID","Metric Name"\n"0","DRAM Throughput"\n')
    with pytest.raises(SystemExit, match="Address"):
        ncu_loops.read_sass_csv(str(p))
