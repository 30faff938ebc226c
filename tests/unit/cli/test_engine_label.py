"""How `fleet hosts` and `fleet deployments` show an engine's version and its table row."""

from __future__ import annotations

from gearshift.cli.fleet import engine_label
from gearshift.cli.output import print_table
from gearshift.v1 import agent_pb2


def test_known_versions_read_plainly_and_others_name_the_row_they_run_with():
    assert engine_label("vllm", "0.11.2", "0.10.2", agent_pb2.VERSION_MATCH_KNOWN) == "vllm 0.11.2"
    # An agent that predates version tables says nothing of the match.
    assert engine_label("vllm", "0.11.2", "", agent_pb2.VERSION_MATCH_UNSPECIFIED) \
        == "vllm 0.11.2"
    assert engine_label("vllm", "0.40.0", "0.18", agent_pb2.VERSION_MATCH_NEAREST) \
        == "vllm 0.40.0 [as 0.18: outside the version table]"
    assert engine_label("sglang", "", "0.5", agent_pb2.VERSION_MATCH_UNKNOWN) \
        == "sglang ? [as 0.5: version unknown]"


def test_the_table_shows_the_label_as_written_not_as_console_markup(capsys):
    label = engine_label("vllm", "0.40.0", "0.18", agent_pb2.VERSION_MATCH_NEAREST)
    print_table("hosts", ["host", "engines", "labels"],
                [("h1", label, "zone=[bold]z1[/bold]")], width=400)
    out = capsys.readouterr().out
    assert "vllm 0.40.0 [as 0.18: outside the version table]" in out
    assert "zone=[bold]z1[/bold]" in out  # an agent's label is data too
