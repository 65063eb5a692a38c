# Runs where the optional :telemetry dependency is available (or the
# stand-in of test/support/telemetry_stand_in.ex, where it is not).
if Code.ensure_loaded?(:telemetry) do
  defmodule EMLXAxon.TelemetryTest do
    use ExUnit.Case, async: false

    alias EMLXAxon.{Scheduler, TestFixtures, TextGeneration}
    alias EMLXAxon.Qwen3.Loader

    @moduletag :fixtures

    setup do
      parent = self()

      id = "emlx_axon_test_#{System.unique_integer([:positive])}"

      events =
        for(
          prefix <- [[:emlx_axon, :load], [:emlx_axon, :generate]],
          suffix <- [:start, :stop, :exception],
          do: prefix ++ [suffix]
        ) ++ [[:emlx_axon, :scheduler, :step], [:emlx_axon, :scheduler, :request]]

      :ok =
        :telemetry.attach_many(
          id,
          events,
          &__MODULE__.handle/4,
          parent
        )

      on_exit(fn -> :telemetry.detach(id) end)
    end

    def handle(event, measurements, metadata, parent),
      do: send(parent, {:telemetry, event, measurements, metadata})

    test "load span" do
      path = TestFixtures.path("qwen3-4bit-g64")
      {:ok, _state} = Loader.load(path)

      assert_received {:telemetry, [:emlx_axon, :load, :start], %{system_time: _}, %{path: ^path}}

      assert_received {:telemetry, [:emlx_axon, :load, :stop],
                       %{duration: _, weight_bytes: bytes, load_ms: _},
                       %{path: ^path, model_type: "qwen3", quantization: %{bits: 4}}}

      assert bytes > 0

      {:error, _} = Loader.load("/no/such/model")

      assert_received {:telemetry, [:emlx_axon, :load, :stop], _,
                       %{error: %EMLXAxon.Error{kind: :io}}}
    end

    test "generate span" do
      tokenizer = TestFixtures.tokenizer()
      state = TestFixtures.model("qwen3-4bit-g64")

      TextGeneration.run(tokenizer, state, ["Hello", "The quick brown fox"],
        max_new_tokens: 8,
        ignore_eos: true
      )

      assert_received {:telemetry, [:emlx_axon, :generate, :start], _,
                       %{batch_size: 2, sampler: :greedy, max_new_tokens: 8}}

      assert_received {:telemetry, [:emlx_axon, :generate, :stop],
                       %{
                         duration: _,
                         generated_tokens: 16,
                         prompt_tokens: prompt_tokens,
                         prefill_ms: _,
                         decode_tokens_per_s: _
                       }, %{finish_reasons: [:length, :length]} = metadata}

      assert prompt_tokens > 2

      # Which engine paths ran: binaries once the engine reports them.
      TestFixtures.assert_paths(metadata, TestFixtures.native_stats(state))

      assert_raise RuntimeError, fn ->
        TextGeneration.stream(tokenizer, state, "Hello", fn _ -> raise "boom" end,
          max_new_tokens: 8
        )
      end

      assert_received {:telemetry, [:emlx_axon, :generate, :exception], _,
                       %{kind: :error, reason: %RuntimeError{}}}
    end

    test "scheduler events" do
      state = TestFixtures.model("qwen3-4bit-g64")
      server = start_supervised!({Scheduler, model: state, prefix_cache_bytes: 0})

      {:ok, result} =
        Scheduler.generate(server, [785, 6722, 315, 9625, 374],
          max_new_tokens: 6,
          ignore_eos: true
        )

      # Every step reports its duration in native units, as spans do.
      assert_received {:telemetry, [:emlx_axon, :scheduler, :step],
                       %{duration: duration, running: _, waiting: _, slots: 8, tokens: _}, %{}}

      assert is_integer(duration) and duration > 0

      assert_received {:telemetry, [:emlx_axon, :scheduler, :request], measurements,
                       %{finish_reason: :length} = metadata}

      assert %{prompt_tokens: 5, generated_tokens: 6, queue_ms: _, constraint_ms: _} =
               measurements

      assert Enum.all?(Map.values(measurements), &is_number/1)
      TestFixtures.assert_paths(metadata, result.stats)
    end
  end
end
