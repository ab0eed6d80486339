"""DKM / eDKM: the peers, workloads and sections of `dkm_quality.py` (the real model, the soft-assignment study, the
main job at LLM shapes, the whole recipe) and the docs fragments of `dkm.py` and `dkm_quality.py`."""
