"""Central differential privacy at the server: the stage the engine calls on every update
and release (stage.py, central_dp.py), the ledger of releases (ledger.py), the accountants
(accounting.py) and the noise (noise.py)."""
