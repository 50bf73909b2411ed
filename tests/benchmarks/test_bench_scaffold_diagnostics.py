"""The SCAFFOLD diagnostics of finished comparison cells: the first runaway is named with the site's size."""

from __future__ import annotations

import json

import pytest

from benchmarks import scaffold_diagnostics


def _cell(norms_by_round):
    records = [{"stage": "start"}]
    for round_num, norms in enumerate(norms_by_round):
        records.append(
            {
                "stage": "round",
                "round": round_num,
                "test_accuracy": 0.1 * (round_num + 1),
                "site_meta": {s: {"scaffold.ctrl.local_norm": n} for s, n in norms.items()},
                "site_num_samples": {"site-1": 300, "site-2": 900},
                "site_num_steps": {"site-1": 5, "site-2": 15},
                "rule_diagnostics": {"scaffold.ctrl.global_norm": 0.5},
            }
        )
    return {"cell": {"seed": 0}, "records": records}


def test_the_first_runaway_names_round_site_samples_and_steps(tmp_path, capsys):
    (tmp_path / "cells").mkdir()
    cell = _cell([{"site-1": 1.0, "site-2": 2.0}, {"site-1": 1.1, "site-2": 30.0}, {"site-1": 1.2, "site-2": 900.0}])
    (tmp_path / "cells" / "a.json").write_text(json.dumps(cell))
    assert scaffold_diagnostics.main([str(tmp_path), "--plot", str(tmp_path / "p.png")]) == 0
    out = capsys.readouterr().out
    assert "round 2: site-2 (900 samples, 15 steps/round), ||c_i|| 2 to 30" in out
    assert (tmp_path / "p.png").stat().st_size > 0


def test_cells_of_other_algorithms_are_left_out_and_a_folder_without_scaffold_is_an_error(tmp_path, capsys):
    (tmp_path / "cells").mkdir()
    scaffold = _cell([{"site-1": 1.0, "site-2": 2.0}, {"site-1": 1.1, "site-2": 30.0}])
    fedavg = _cell([{}, {}])
    for record in fedavg["records"][1:]:
        record["rule_diagnostics"] = {}
    (tmp_path / "cells" / "a.json").write_text(json.dumps(scaffold))
    (tmp_path / "cells" / "b.json").write_text(json.dumps(fedavg))
    assert scaffold_diagnostics.main([str(tmp_path), "--plot", str(tmp_path / "p.png")]) == 0
    table_rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(f"| {tmp_path.name} |")]
    assert len(table_rows) == 1 and "site-2" in table_rows[0]
    (tmp_path / "cells" / "a.json").unlink()
    with pytest.raises(SystemExit, match=r"no finished SCAFFOLD cells .* \(1 cells of other algorithms\)"):
        scaffold_diagnostics.load(tmp_path)
