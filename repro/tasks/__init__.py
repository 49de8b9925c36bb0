"""Tasks: each module has run(cfg) -> headline metric, and may have aggregate(rows, out_dir)
for the end of a multirun. conf/task/<name>.yaml points its _target_ at run."""
