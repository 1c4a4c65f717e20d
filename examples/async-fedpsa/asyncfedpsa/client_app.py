"""asyncfedpsa: a plain Flower ClientApp plus one line, FedPSA's client mod (it adds the
sketch of the trained model's sensitivity to every train reply)."""

from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

import fedstale
from asyncfedpsa.task import INPUT_SHAPE, Net, fit, node_data

app = ClientApp(mods=[fedstale.fedpsa_mod(Net, input_shape=INPUT_SHAPE)])


@app.train()
def train(msg: Message, context: Context) -> Message:
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    x, y = node_data(
        context.node_config["partition-id"],
        context.node_config["num-partitions"],
        context.run_config["dirichlet-alpha"],
    )
    config = context.run_config
    loss = fit(
        model, x, y, config["local-epochs"], msg.content["config"]["lr"], config["batch-size"]
    )
    metrics = MetricRecord({"train_loss": loss, "num-examples": len(y)})
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": metrics})
    return Message(content=content, reply_to=msg)
