defmodule Mix.Tasks.EmlxAxon.GenerateTest do
  use ExUnit.Case, async: false

  import ExUnit.CaptureIO

  alias EMLXAxon.{TestFixtures, TestJSON, Tokenizer}

  @moduletag :fixtures

  # The references are mlx-lm's float32 ids; the default dtype is bfloat16
  # on a GPU, whose greedy ids may part from them after a few tokens.
  @exact ["--dtype", "float32"]

  defp run_task(args) do
    Mix.Task.reenable("emlx_axon.generate")
    capture_io(fn -> Mix.Tasks.EmlxAxon.Generate.run(args) end)
  end

  test "--json prints one JSON object with the reference ids" do
    for name <- ["qwen3-4bit-g64", "qwen2-4bit-g64"] do
      %{"prompt_ids" => prompt_ids, "greedy_ids" => greedy} =
        TestFixtures.reference(name)["prompts"]["plain"]

      ids = Enum.join(prompt_ids, ",")

      output =
        run_task([
          "--model",
          TestFixtures.path(name),
          "--prompt-ids",
          ids,
          "--max-new-tokens",
          "16",
          "--json"
          | @exact
        ])

      assert [line] = String.split(output, "\n", trim: true)

      assert %{
               "prompt_ids" => ^prompt_ids,
               "generated_ids" => ^greedy,
               "text" => text,
               "finish_reason" => "length",
               "prefill_ms" => prefill,
               "decode_tokens_per_s" => tps,
               "time_to_first_token_ms" => ttft
             } = TestJSON.decode!(line)

      assert {:ok, ^text} = Tokenizer.decode(TestFixtures.tokenizer(name), greedy)
      assert Enum.all?([prefill, tps, ttft], &(is_number(&1) and &1 > 0))
    end
  end

  test "the default model, --prompt and --chat" do
    %{"prompt_ids" => plain_ids, "greedy_ids" => greedy} =
      TestFixtures.reference("qwen3-4bit-g64")["prompts"]["plain"]

    %{"prompt_ids" => chat_ids} = TestFixtures.reference("qwen3-4bit-g64")["prompts"]["chat"]

    json =
      run_task([
        "--prompt",
        "The quick brown fox jumps over the lazy dog.",
        "--max-new-tokens",
        "16",
        "--json"
        | @exact
      ])

    assert %{"prompt_ids" => ^plain_ids, "generated_ids" => ^greedy} = TestJSON.decode!(json)

    # In the default dtype of this device.
    json =
      run_task([
        "--chat",
        "--prompt",
        "Give me a short introduction to large language models.",
        "--json"
      ])

    assert %{"prompt_ids" => ^chat_ids, "generated_ids" => ids} = TestJSON.decode!(json)
    assert length(ids) <= 32
  end

  test "streams the text, then a timing line" do
    %{"greedy_ids" => greedy} = TestFixtures.reference("qwen3-4bit-g64")["prompts"]["plain"]
    {:ok, text} = Tokenizer.decode(TestFixtures.tokenizer(), greedy)

    output =
      run_task([
        "--prompt",
        "The quick brown fox jumps over the lazy dog.",
        "--max-new-tokens",
        "16"
        | @exact
      ])

    assert String.starts_with?(output, text <> "\n")
    assert output =~ ~r/16 tokens \(length\).*prefill [\d.]+ ms.*tokens\/s/
  end

  test "sampling options" do
    args = [
      "--max-new-tokens",
      "8",
      "--sampler",
      "top_p_cpu",
      "--seed",
      "3",
      "--temperature",
      "0.8",
      "--top-p",
      "0.9",
      "--top-k",
      "50",
      "--json"
    ]

    first = TestJSON.decode!(run_task(args))
    second = TestJSON.decode!(run_task(args))

    assert Map.take(first, ["generated_ids", "text"]) ==
             Map.take(second, ["generated_ids", "text"])

    assert length(first["generated_ids"]) <= 8
  end

  test "--help prints every option" do
    output = run_task(["--help"])
    assert output =~ "Usage: mix emlx_axon.generate [options]"

    for {switch, _type} <- [help: nil, model: nil, max_len: nil, max_new_tokens: nil, json: nil] do
      assert output =~ "--#{switch |> Atom.to_string() |> String.replace("_", "-")}"
    end

    assert run_task(["-h"]) == output
  end

  test "--max-len is the KV cache length" do
    %{"prompt_ids" => prompt_ids} = TestFixtures.reference("qwen3-4bit-g64")["prompts"]["plain"]
    ids = Enum.join(prompt_ids, ",")
    args = ["--prompt-ids", ids, "--max-new-tokens", "16", "--json" | @exact]

    # Room for the prompt and 3 more tokens: generation stops at the cache's end.
    max_len = length(prompt_ids) + 3
    json = TestJSON.decode!(run_task(args ++ ["--max-len", "#{max_len}"]))
    assert %{"finish_reason" => "max_len", "generated_ids" => generated} = json
    assert length(generated) == 3

    assert_raise Mix.Error, ~r/prompt/, fn ->
      run_task(args ++ ["--max-len", "#{length(prompt_ids)}"])
    end

    assert_raise Mix.Error, ~r/max_len/, fn -> run_task(args ++ ["--max-len", "0"]) end

    assert_raise Mix.Error, ~r/invalid option --max-len x: --max-len takes an integer/, fn ->
      run_task(["--max-len", "x"])
    end
  end

  test "--kv-bits and --max-kv-size reach the generation" do
    %{"prompt_ids" => prompt_ids} = TestFixtures.reference("qwen3-4bit-g64")["prompts"]["plain"]
    ids = Enum.join(prompt_ids, ",")
    args = ["--prompt-ids", ids, "--max-new-tokens", "8", "--json" | @exact]

    quantized = ["--kv-bits", "8", "--kv-group-size", "32", "--quantized-kv-start", "0"]

    for extra <- [quantized, ["--max-kv-size", "8"]] do
      json = TestJSON.decode!(run_task(args ++ extra))
      assert %{"finish_reason" => "length", "generated_ids" => generated} = json
      assert length(generated) == 8
    end

    # The fixture's heads are 32 values wide: a group of 64 is refused.
    assert_raise Mix.Error, ~r/kv_group_size \(64\) must divide/, fn ->
      run_task(args ++ ["--kv-bits", "8"])
    end
  end

  test "a bad flag is named, with the accepted ones" do
    error = assert_raise Mix.Error, fn -> run_task(["--max-tokens", "3"]) end
    assert error.message =~ "invalid option --max-tokens: unknown option"
    assert error.message =~ "--max-new-tokens"
    assert error.message =~ "--max-len"
    assert error.message =~ "--help"

    assert_raise Mix.Error, ~r/--temperature takes a number/, fn ->
      run_task(["--temperature", "warm"])
    end

    assert_raise Mix.Error, ~r/--offline applies to --model hf:REPO/, fn ->
      run_task(["--offline"])
    end
  end

  test "errors are Mix errors" do
    assert_raise Mix.Error, ~r/does not exist/, fn -> run_task(["--model", "/no/such/model"]) end
    assert_raise Mix.Error, ~r/invalid option/, fn -> run_task(["--max-new-tokens", "many"]) end
    assert_raise Mix.Error, ~r/invalid option/, fn -> run_task(["--bogus"]) end

    assert_raise Mix.Error, ~r/--sampler must be one of/, fn ->
      run_task(["--sampler", "beam"])
    end

    assert_raise Mix.Error, ~r/--prompt-ids must be comma-separated/, fn ->
      run_task(["--prompt-ids", "1,x"])
    end

    assert_raise Mix.Error, ~r/max_new_tokens/, fn -> run_task(["--max-new-tokens", "0"]) end

    assert_raise Mix.Error,
                 ~r/--dtype must be one of float32, bfloat16, float16, got: float64/,
                 fn -> run_task(["--dtype", "float64"]) end

    assert_raise Mix.Error, ~r/unexpected argument/, fn -> run_task(["extra"]) end
  end
end
