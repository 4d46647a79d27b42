"""The run report's page: one self-contained HTML file (styles inline, images as data: URIs, no script).

The "wrong answers only" filter is a checkbox and a CSS sibling rule: it works without JavaScript.
"""

from __future__ import annotations

from string import Template

PAGE = Template("""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>vlmtrain report: $title</title>
<style>
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; color: #222; margin: 0 auto;
       max-width: 1240px; padding: 16px 24px 48px; }
h1 { font-size: 22px; margin: 8px 0 4px; }
h2 { font-size: 18px; margin: 28px 0 8px; border-bottom: 1px solid #ddd; padding-bottom: 4px; }
h3 { font-size: 15px; margin: 16px 0 6px; }
.meta, .note { color: #666; font-size: 13px; }
.warn { color: #8a5300; background: #fff6e0; padding: 6px 10px; border-radius: 4px; }
.summary td { padding: 2px 16px 2px 0; }
.charts { display: flex; flex-wrap: wrap; gap: 8px; }
.charts img { box-sizing: border-box; width: calc(50% - 4px); min-width: 400px; max-width: 100%; height: auto; border: 1px solid #eee; }
.table-wrap { overflow-x: auto; }
table.metrics { border-collapse: collapse; font-size: 13px; font-variant-numeric: tabular-nums; }
table.metrics th, table.metrics td { border: 1px solid #ddd; padding: 3px 8px; text-align: right; }
table.metrics th:first-child, table.metrics td:first-child { text-align: left; }
table.metrics thead th { background: #f5f5f5; vertical-align: bottom; }
table.metrics tr.group td { background: #fafafa; font-weight: 600; text-align: left; }
table.metrics th.baseline, table.metrics td.baseline { background: #f7f7fb; color: #555; }
.tag { display: inline-block; font-size: 11px; padding: 0 5px; border-radius: 3px; font-weight: 600; }
.tag.inline { background: #e3effa; color: #1f5f99; }
.tag.async { background: #fdebd3; color: #9a5300; }
.filter { margin: 8px 0 4px; font-weight: 600; }
details.step { margin: 10px 0; }
details.step > summary { cursor: pointer; font-size: 15px; font-weight: 600; padding: 4px 0; }
.cards { display: flex; flex-wrap: wrap; gap: 8px; }
.card { box-sizing: border-box; width: 230px; border: 1px solid #ddd; border-left: 4px solid #bbb; border-radius: 4px; padding: 6px 8px;
        font-size: 12.5px; background: #fff; }
.card.right { border-left-color: #2e9d4f; }
.card.wrong { border-left-color: #d33; background: #fff8f8; }
.card .thumbs { display: flex; gap: 4px; margin-bottom: 4px; min-height: 4px; }
.thumb { width: 96px; height: 96px; background: #f3f3f3 center / contain no-repeat; border: 1px solid #e5e5e5;
         image-rendering: pixelated; }
.thumb.missing { display: flex; align-items: center; justify-content: center; color: #999; font-size: 11px; }
.card .set { color: #777; font-size: 11px; }
.card .q { margin: 2px 0; }
.card .verdict { font-weight: 600; }
.card.right .verdict { color: #2e9d4f; }
.card.wrong .verdict { color: #c22; }
#wrong-only:checked ~ .galleries .card.right { display: none; }
table.completions td { text-align: left; white-space: pre-wrap; vertical-align: top; max-width: 520px; }
pre { background: #f7f7f7; padding: 8px; overflow-x: auto; font-size: 12px; }
$thumbnail_styles
</style>
</head>
<body>
<h1>vlmtrain run report</h1>
<div class="meta">$meta</div>
$warnings
<h2>Summary</h2>
$summary
<h2>Training curves</h2>
<div class="charts">$train_charts</div>
$completions
<h2>Evaluation</h2>
$eval_section
<h2>Held-out samples</h2>
$gallery
$config
</body>
</html>
""")


def thumbnail_style(class_name: str, data_uri: str) -> str:
    """The CSS rule that shows one stored thumbnail (each image is embedded once, whatever uses it)."""
    return f".{class_name} {{ background-image: url({data_uri}); }}"
