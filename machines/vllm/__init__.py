"""Machines of kvhandoff's vLLM connector: what the connector owes vLLM's engine.

Pure declarations (no vLLM import): `vllm.owed_report` on the scheduler role,
`vllm.rank_receive` on each worker role."""
