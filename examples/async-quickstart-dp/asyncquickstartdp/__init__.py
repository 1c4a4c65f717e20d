"""asyncquickstartdp: the quickstart with central differential privacy, asynchronous."""
