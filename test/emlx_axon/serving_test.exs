# Runs only where Nx is available (this repository builds without Hex, so
# these tests run in applications or CI setups that bring Nx).
if Code.ensure_loaded?(Nx.Serving) do
  defmodule EMLXAxon.TextGeneration.ServingTest do
    use ExUnit.Case, async: false

    alias EMLXAxon.{Error, TestFixtures, TextGeneration}

    @moduletag :fixtures

    @plain "The quick brown fox jumps over the lazy dog."
    @chat [%{role: "user", content: "Give me a short introduction to large language models."}]
    @opts [max_new_tokens: 16]

    setup_all do
      name = "qwen3-4bit-g64"
      %{tokenizer: TestFixtures.tokenizer(name), state: TestFixtures.model(name)}
    end

    defp results(outputs) when is_list(outputs), do: Enum.map(outputs, & &1.results)
    defp results(output), do: output.results

    test "Nx.Serving.run/2 gives run/4's results", %{tokenizer: tokenizer, state: state} do
      reference = TestFixtures.reference("qwen3-4bit-g64")["prompts"]
      plain_ids = reference["plain"]["greedy_ids"]

      for opts <- [
            @opts,
            [max_new_tokens: 24, stop: ["the"]],
            @opts ++ [eos_token_ids: [Enum.at(plain_ids, 3)]]
          ] do
        serving = TextGeneration.serving(tokenizer, state, opts)

        for input <- [@plain, @chat, %{text: @plain}, [@plain, @chat, "Hello"]] do
          assert results(Nx.Serving.run(serving, input)) ==
                   results(TextGeneration.run(tokenizer, state, input, opts)),
                 "#{inspect(input)} with #{inspect(opts)}"
        end
      end

      assert %{results: [%{token_ids: ^plain_ids}], metadata: %{batch_size: 1, prompt_tokens: 10}} =
               Nx.Serving.run(TextGeneration.serving(tokenizer, state, @opts), @plain)
    end

    test "from_mlx4bit/3", %{tokenizer: tokenizer, state: state} do
      serving = TextGeneration.from_mlx4bit(TestFixtures.path("qwen3-4bit-g64"), nil, @opts)

      assert results(Nx.Serving.run(serving, @plain)) ==
               results(TextGeneration.run(tokenizer, state, @plain, @opts))
    end

    test "batched_run/2 batches concurrent callers", %{tokenizer: tokenizer, state: state} do
      serving = TextGeneration.serving(tokenizer, state, @opts)
      name = :"serving_#{System.unique_integer([:positive])}"

      start_supervised!(
        {Nx.Serving, serving: serving, name: name, batch_size: 4, batch_timeout: 100}
      )

      inputs = [@plain, @chat, "Hello", "1, 2, 3,", "Elixir is", [@plain, "Hi"], @chat]
      expected = Enum.map(inputs, &results(TextGeneration.run(tokenizer, state, &1, @opts)))

      actual =
        inputs
        |> Enum.map(fn input ->
          Task.async(fn -> results(Nx.Serving.batched_run(name, input)) end)
        end)
        |> Task.await_many(60_000)

      assert actual == expected
    end

    test "partitions each get a stream", %{tokenizer: tokenizer, state: state} do
      serving =
        TextGeneration.serving(tokenizer, state, @opts ++ [defn_options: [max_concurrency: 2]])

      name = :"serving_#{System.unique_integer([:positive])}"

      start_supervised!(
        {Nx.Serving,
         serving: serving, name: name, batch_size: 2, batch_timeout: 10, partitions: true}
      )

      inputs = [@plain, "Hello", @chat] |> List.duplicate(3) |> Enum.concat()
      expected = Enum.map(inputs, &results(TextGeneration.run(tokenizer, state, &1, @opts)))

      actual =
        inputs
        |> Enum.map(fn input ->
          Task.async(fn -> results(Nx.Serving.batched_run(name, input)) end)
        end)
        |> Task.await_many(60_000)

      assert actual == expected
    end

    test "a streaming serving yields text chunks", %{tokenizer: tokenizer, state: state} do
      for input <- [@plain, @chat] do
        %{results: [expected]} = TextGeneration.run(tokenizer, state, input, @opts)

        serving = TextGeneration.serving(tokenizer, state, @opts ++ [stream: true])
        chunks = serving |> Nx.Serving.run(input) |> Enum.to_list()
        assert Enum.all?(chunks, &(is_binary(&1) and &1 != ""))
        assert IO.iodata_to_binary(chunks) == expected.generated_text

        serving =
          TextGeneration.serving(tokenizer, state, @opts ++ [stream: true, stream_done: true])

        events = serving |> Nx.Serving.run(input) |> Enum.to_list()
        assert {:done, %{results: [^expected]}} = List.last(events)
        assert IO.iodata_to_binary(Enum.drop(events, -1)) == expected.generated_text
      end
    end

    test "a streaming serving process", %{tokenizer: tokenizer, state: state} do
      serving = TextGeneration.serving(tokenizer, state, @opts ++ [stream: true])
      name = :"serving_#{System.unique_integer([:positive])}"

      start_supervised!(
        {Nx.Serving, serving: serving, name: name, batch_size: 2, batch_timeout: 50}
      )

      inputs = [@plain, "Hello", @chat]

      expected =
        Enum.map(
          inputs,
          &hd(TextGeneration.run(tokenizer, state, &1, @opts).results).generated_text
        )

      actual =
        inputs
        |> Enum.map(fn input ->
          Task.async(fn -> name |> Nx.Serving.batched_run(input) |> Enum.join() end)
        end)
        |> Task.await_many(60_000)

      assert actual == expected
    end

    test "errors", %{tokenizer: tokenizer, state: state} do
      streaming = TextGeneration.serving(tokenizer, state, stream: true)

      assert_raise ArgumentError, ~r/one input at a time/, fn ->
        Nx.Serving.run(streaming, ["a", "b"])
      end

      serving = TextGeneration.serving(tokenizer, state, max_len: 5)
      assert_raise Error, ~r/prompt_too_long/, fn -> Nx.Serving.run(serving, @plain) end
      assert_raise ArgumentError, ~r/empty list/, fn -> Nx.Serving.run(serving, []) end
    end
  end
end
