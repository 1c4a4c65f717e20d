"""asyncfedpsa: FedPSA (fedstale) on a plain Flower / PyTorch app."""
