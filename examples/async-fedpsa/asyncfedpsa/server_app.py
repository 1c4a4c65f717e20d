"""asyncfedpsa: fedstale's FedPSA in a Flower ServerApp. FedPSA sketches the global model
at the server too, so it takes the model factory and one sample's shape."""

from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp

from asyncfedpsa.task import INPUT_SHAPE, Net, held_out, score
from fedstale import FedPSA

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    strategy = FedPSA(
        model_fn=Net, input_shape=INPUT_SHAPE, buffer_size=3, concurrency=4, fraction_evaluate=0
    )
    strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(Net().state_dict()),
        train_config=ConfigRecord({"lr": context.run_config["learning-rate"]}),
        num_rounds=int(context.run_config["num-server-rounds"]),
        evaluate_fn=global_evaluate,
    )


def global_evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
    model = Net()
    model.load_state_dict(arrays.to_torch_state_dict())
    loss, accuracy = score(model, *held_out())
    return MetricRecord({"accuracy": accuracy, "loss": loss})
