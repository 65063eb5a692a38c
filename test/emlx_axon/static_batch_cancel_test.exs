defmodule EMLXAxon.TextGeneration.StaticBatchCancelTest do
  # A static serving's execution ends the row of a caller that exited within
  # a step, while the batch's other rows run to their end. Runs without Nx:
  # an execution takes the requests and callers as plain data.
  use ExUnit.Case, async: true

  alias EMLXAxon.TestFixtures
  alias EMLXAxon.TextGeneration.{Config, Input}
  alias EMLXAxon.TextGeneration.Serving.{Batch, Execution, Results}

  @moduletag :fixtures
  @fixture "qwen3-4bit-g64"

  setup_all do
    %{tokenizer: TestFixtures.tokenizer(@fixture), state: TestFixtures.model(@fixture)}
  end

  defp execute(ctx, inputs, callers, opts) do
    opts = Config.serving!(opts)
    {requests, true} = Input.requests!(ctx.tokenizer, ctx.state, inputs, opts)
    width = Batch.width!(requests, opts)
    requests = requests |> Batch.encode(width) |> Batch.decode(width, length(requests))
    arg = %{tokenizer: ctx.tokenizer, state: ctx.state, opts: opts}

    arg
    |> Execution.run(requests, nil, nil, callers)
    |> Map.new(fn {name, {_type, _shape, binary}} -> {name, binary} end)
    |> Results.decode(opts.max_new_tokens)
  end

  defp exited do
    {pid, ref} = spawn_monitor(fn -> :ok end)
    assert_receive {:DOWN, ^ref, :process, ^pid, _}
    pid
  end

  test "a row whose caller exited ends :cancelled after one step; the others decode on", ctx do
    opts = [max_new_tokens: 40, ignore_eos: true]
    inputs = ["Hello", "The quick brown fox"]

    assert [gone, kept] = execute(ctx, inputs, [exited(), self()], opts)
    assert gone.finish_reason == :cancelled
    assert length(gone.ids) == 1
    assert kept.finish_reason == :length
    assert length(kept.ids) == 40

    # The row that went on decodes as it does beside a caller that stayed.
    assert [_, beside] = execute(ctx, inputs, [self(), self()], opts)
    assert {beside.ids, beside.finish_reason} == {kept.ids, kept.finish_reason}
  end

  test "a batch whose callers all exited stops after its first step", ctx do
    opts = [max_new_tokens: 40, ignore_eos: true]
    rows = execute(ctx, ["Hello", "Hi"], [exited(), exited()], opts)
    assert Enum.map(rows, &{length(&1.ids), &1.finish_reason}) == [{1, :timeout}, {1, :timeout}]
  end
end
