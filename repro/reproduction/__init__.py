"""The top floor: tools that run the experiments and read their results, never imported by the
floors below. report (results/ -> REPORT.md) and claims (the verdicts), reproduce_gpu (every GPU
result in resumable steps), bench (the causal dot product against its peers on one device),
cpu_speed (the core's CPU speed), peers (the authors' kernel, fla), sanitize (compute-sanitizer's
launches)."""
