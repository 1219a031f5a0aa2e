"""Facts the orchestrator and the engines share, stdlib only (no torch, nothing of ours): the parallel
layout rules, upstream flag and key tables. Everything may import this package; it imports nothing
of the project, so `validate` stays instant and an engine never imports the orchestrator."""
