"""Secure aggregation for buffered asynchronous rules, as plain arrays: the finite field and
quantisation (field.py), the encoded masks of LightSecAgg and BASecAgg (coding.py), and the
shares sealed between clients (sealing.py). The client half is a Flower mod
(fedstale/client_app/secagg.py); the server's half is a stage of the engine."""
