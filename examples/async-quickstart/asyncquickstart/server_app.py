"""asyncquickstart: Flower's quickstart ServerApp with one line changed, the strategy."""

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp

from asyncquickstart.task import Net, load_centralized_dataset, test
from fedstale import FedBuff

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Main entry point for the ServerApp."""
    fraction_evaluate = float(context.run_config["fraction-evaluate"])
    num_rounds = int(context.run_config["num-server-rounds"])
    lr = float(context.run_config["learning-rate"])

    global_model = Net()
    arrays = ArrayRecord(global_model.state_dict())

    # The one line that changes: Flower's FedAvg(fraction_evaluate=...) becomes fedstale's
    # FedBuff, which aggregates updates as they arrive instead of waiting for every node.
    strategy = FedBuff(fraction_evaluate=fraction_evaluate, buffer_size=3, concurrency=4)

    result = strategy.start(
        grid=grid,
        initial_arrays=arrays,
        train_config=ConfigRecord({"lr": lr}),
        num_rounds=num_rounds,
        evaluate_fn=global_evaluate,
    )

    print("\nSaving final model to disk...")
    torch.save(result.arrays.to_torch_state_dict(), "final_model.pt")


def global_evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
    """Evaluate the global model on the held-out data."""
    model = Net()
    model.load_state_dict(arrays.to_torch_state_dict())
    test_loss, test_acc = test(model, load_centralized_dataset(), "cpu")
    return MetricRecord({"accuracy": test_acc, "loss": test_loss})
