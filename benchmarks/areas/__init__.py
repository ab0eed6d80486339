"""One package per measured area, each over the harness (`harness`) and none importing another's modules, except
`catalog`, which imports every area's `fragments` module: the fragments `report.py` renders."""
