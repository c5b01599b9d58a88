"""``python -m offgraph_export`` is the ``offgraph-export`` command."""

from offgraph_export.cli.main import cli

cli()
