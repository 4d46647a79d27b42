"""Synthetic tasks, as data sources like any other: each brings its own options, metrics and demo report.

Importing this package registers them with data/, which names no task (``vlmtrain/__init__.py`` imports it, so
every use of vlmtrain sees them): ``data.source`` addition / shapes / shapes_scores / shapes_pairs /
moving_shapes, the ``shapes`` kind of a
``data.sources`` entry and ``shapes[:N]`` for ``vlmtrain data``.
"""

from vlmtrain.data.registry import register_command_line_source, register_source, register_stream_kind
from vlmtrain.tasks import shapes_source

register_source("addition", "vlmtrain.tasks.addition_source")
register_source("shapes", "vlmtrain.tasks.shapes_source")
register_source("shapes_scores", "vlmtrain.tasks.shapes_scores_source")
register_source("shapes_pairs", "vlmtrain.tasks.shapes_pairs_source")
register_source("moving_shapes", "vlmtrain.tasks.moving_shapes_source")
register_stream_kind("shapes", shapes_source.stream_source)
register_command_line_source("shapes", shapes_source.command_line_source)
