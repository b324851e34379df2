"""What a run measures as it trains: throughput, model FLOPs utilisation and the gradient
noise scale; and the throughput of several configurations side by side."""
