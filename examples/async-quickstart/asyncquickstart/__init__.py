"""asyncquickstart: a Flower / PyTorch app with an asynchronous server (fedstale)."""
