"""asyncquickstartdp: the quickstart's ServerApp with central differential privacy: the
clients clip (Flower's fixedclipping_mod), the server adds Gaussian noise to every new
global model and accounts the privacy spent with Flower's RdpAccountant."""

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from flwr.supercore.privacy_accounting import (
    NeighboringRelation,
    PrivacyConfig,
    SamplingMethod,
)
from flwr.supercore.privacy_accounting.rdp_accountant import RdpAccountant

from asyncquickstartdp.task import Net, load_centralized_dataset, test
from fedstale import DifferentialPrivacyClientSideFixedClipping, FedBuff

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Main entry point for the ServerApp."""
    config = context.run_config
    buffer_size = 3
    strategy = FedBuff(
        fraction_evaluate=float(config["fraction-evaluate"]),
        buffer_size=buffer_size,
        concurrency=4,
        num_clients=int(config["num-clients"]),
    )
    # Flower's wrapper, with Flower's arguments, around an asynchronous strategy: every
    # buffer flush is one private release of `buffer_size` clipped updates.
    accountant = RdpAccountant(
        PrivacyConfig(
            target_delta=float(config["target-delta"]),
            population_size=int(config["num-clients"]),
            # An asynchronous server does not sample its clients uniformly at random.
            neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE,
            sampling_method=SamplingMethod.NO_AMPLIFICATION,
            max_epsilon=float(config["max-epsilon"]) or None,  # 0: no budget
        )
    )
    dp_strategy = DifferentialPrivacyClientSideFixedClipping(
        strategy,
        noise_multiplier=float(config["noise-multiplier"]),
        clipping_norm=float(config["clipping-norm"]),
        num_sampled_clients=buffer_size,
        accountant=accountant,
    )
    result = dp_strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(Net().state_dict()),
        train_config=ConfigRecord({"lr": config["learning-rate"]}),
        num_rounds=int(config["num-server-rounds"]),
        evaluate_fn=global_evaluate,
    )
    spent = result.privacy
    print(
        f"\nPrivacy spent: epsilon {spent.epsilon:.2f} at delta {spent.delta:g} "
        f"over {spent.num_releases} releases"
    )
    torch.save(result.arrays.to_torch_state_dict(), "final_model.pt")


def global_evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
    """Evaluate the global model on the held-out data."""
    model = Net()
    model.load_state_dict(arrays.to_torch_state_dict())
    test_loss, test_acc = test(model, load_centralized_dataset(), "cpu")
    return MetricRecord({"accuracy": test_acc, "loss": test_loss})
