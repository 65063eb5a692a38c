defmodule Mix.Tasks.EmlxAxon.Generate do
  @shortdoc "Generates text with a Qwen checkpoint"

  @moduledoc """
  Generates text with a Qwen checkpoint, printing it as it is generated,
  then a timing line.

      mix emlx_axon.generate
      mix emlx_axon.generate --model ~/models/Qwen3-0.6B-MLX-4bit --chat --prompt "Name three rivers."
      mix emlx_axon.generate --prompt-ids 785,6722,315,9625,374 --max-new-tokens 8 --json

  ## Options

    * `--model DIR` - the checkpoint directory (default: the small test
      checkpoint `.cache/fixtures/qwen3-4bit-g64` that `scripts/setup` builds)
    * `--prompt TEXT` - the prompt (default: `"The capital of France is"`)
    * `--prompt-ids 1,2,3` - a tokenized prompt, instead of `--prompt`
    * `--chat` - render the prompt with the chat template, as a user message
    * `--dtype float32|bfloat16|float16` - the compute dtype (default:
      float32 on the CPU, bfloat16 on a GPU)
    * `--max-new-tokens N` - default 32
    * `--sampler greedy|top_p_cpu|top_p_gpu` - default `greedy`
    * `--seed N`, `--temperature F`, `--top-p F`, `--top-k N`
    * `--json` - print exactly one JSON object instead, with the keys
      `prompt_ids`, `generated_ids`, `text`, `finish_reason`, `prefill_ms`,
      `decode_tokens_per_s` and `time_to_first_token_ms`
  """

  use Mix.Task

  alias EMLXAxon.{JSON, TextGeneration, Tokenizer}
  alias EMLXAxon.Qwen3.Loader

  @default_model ".cache/fixtures/qwen3-4bit-g64"
  @default_prompt "The capital of France is"

  @switches [
    model: :string,
    prompt: :string,
    prompt_ids: :string,
    chat: :boolean,
    dtype: :string,
    max_new_tokens: :integer,
    sampler: :string,
    seed: :integer,
    temperature: :float,
    top_p: :float,
    top_k: :integer,
    json: :boolean
  ]

  @impl Mix.Task
  def run(argv) do
    {opts, args, invalid} = OptionParser.parse(argv, strict: @switches)

    cond do
      invalid != [] ->
        Mix.raise("invalid option(s): #{Enum.map_join(invalid, ", ", &format_invalid/1)}")

      args != [] ->
        Mix.raise(
          "unexpected argument(s): #{Enum.join(args, " ")}; see `mix help emlx_axon.generate`"
        )

      true ->
        :ok
    end

    json? = Keyword.get(opts, :json, false)
    start_app(json?)

    model = opts |> Keyword.get_lazy(:model, &default_model/0) |> Path.expand()

    unless File.dir?(model) do
      Mix.raise(
        "model directory #{model} does not exist. " <>
          if(opts[:model],
            do: "Pass --model with a checkpoint directory.",
            else: "Run scripts/setup to build the test checkpoints, or pass --model DIR."
          )
      )
    end

    load_opts = if dtype = opts[:dtype], do: [dtype: parse_dtype!(dtype)], else: []
    tokenizer = ok!(Tokenizer.load(model), "loading the tokenizer from #{model}")
    state = ok!(Loader.load(model, load_opts), "loading the model from #{model}")

    input =
      case opts[:prompt_ids] do
        nil ->
          prompt = Keyword.get(opts, :prompt, @default_prompt)
          if opts[:chat], do: [%{role: "user", content: prompt}], else: prompt

        ids ->
          if opts[:prompt], do: Mix.raise("give either --prompt or --prompt-ids, not both")
          if opts[:chat], do: Mix.raise("--chat applies to --prompt, not --prompt-ids")
          %{input_ids: parse_ids!(ids)}
      end

    gen_opts =
      [
        max_new_tokens: Keyword.get(opts, :max_new_tokens, 32),
        sampler: parse_sampler!(Keyword.get(opts, :sampler, "greedy")),
        profile_timing: true
      ] ++ Keyword.take(opts, [:seed, :temperature, :top_p, :top_k])

    {:ok, prompt_ids} = prompt_ids(tokenizer, state, input)

    output =
      try do
        if json? do
          TextGeneration.run(tokenizer, state, input, gen_opts)
        else
          result = TextGeneration.stream(tokenizer, state, input, &IO.write/1, gen_opts)
          IO.write("\n")
          result
        end
      rescue
        e in [ArgumentError, EMLXAxon.Error] -> Mix.raise(Exception.message(e))
      end

    %{results: [%{token_ids: ids, generated_text: text, finish_reason: reason}], metadata: meta} =
      output

    if json? do
      IO.puts(
        JSON.encode!(%{
          prompt_ids: prompt_ids,
          generated_ids: ids,
          text: text,
          finish_reason: reason,
          prefill_ms: meta.prefill_ms,
          decode_tokens_per_s: meta.decode_tokens_per_s,
          time_to_first_token_ms: meta.time_to_first_token_ms
        })
      )
    else
      Mix.shell().info(
        "-- #{length(ids)} tokens (#{reason}); prompt #{length(prompt_ids)} tokens, " <>
          "prefill #{fmt(meta.prefill_ms)} ms, first token #{fmt(meta.time_to_first_token_ms)} ms, " <>
          "decode #{fmt(meta.decode_tokens_per_s)} tokens/s"
      )
    end

    :ok
  end

  defp start_app(json?) do
    # With --json, stdout must hold only the JSON object.
    if json? do
      shell = Mix.shell()
      Mix.shell(Mix.Shell.Quiet)

      try do
        Mix.Task.run("app.start")
      after
        Mix.shell(shell)
      end
    else
      Mix.Task.run("app.start")
    end
  end

  defp prompt_ids(tokenizer, state, input) do
    opts = %{chat: false, enable_thinking: nil}
    {[%{ids: ids}], false} = TextGeneration.Input.requests!(tokenizer, state, input, opts)
    {:ok, ids}
  rescue
    e in [ArgumentError, EMLXAxon.Error] -> Mix.raise(Exception.message(e))
  end

  defp default_model do
    root =
      case Mix.Project.deps_paths()[:emlx_axon] do
        nil -> Path.dirname(Mix.Project.project_file() || Path.join(File.cwd!(), "mix.exs"))
        dep_path -> dep_path
      end

    Path.join(root, @default_model)
  end

  defp parse_ids!(ids) do
    ids
    |> String.split(",", trim: true)
    |> Enum.map(fn id ->
      case Integer.parse(String.trim(id)) do
        {int, ""} when int >= 0 -> int
        _ -> Mix.raise("--prompt-ids must be comma-separated token ids, got: #{inspect(ids)}")
      end
    end)
    |> case do
      [] -> Mix.raise("--prompt-ids must not be empty")
      list -> list
    end
  end

  @dtypes ~w(float32 bfloat16 float16)

  defp parse_dtype!(name) do
    if name in @dtypes do
      String.to_existing_atom(name)
    else
      Mix.raise("--dtype must be one of #{Enum.join(@dtypes, ", ")}, got: #{name}")
    end
  end

  defp parse_sampler!(name) do
    case Enum.find(EMLXAxon.Options.samplers(), &(Atom.to_string(&1) == name)) do
      nil ->
        Mix.raise(
          "--sampler must be one of " <>
            Enum.map_join(EMLXAxon.Options.samplers(), ", ", &Atom.to_string/1) <>
            ", got: #{name}"
        )

      sampler ->
        sampler
    end
  end

  defp ok!({:ok, value}, _what), do: value
  defp ok!({:error, error}, what), do: Mix.raise("#{what} failed: #{Exception.message(error)}")

  defp fmt(number) when is_float(number), do: :erlang.float_to_binary(number, decimals: 1)
  defp fmt(number), do: to_string(number)

  defp format_invalid({name, nil}), do: name
  defp format_invalid({name, value}), do: "#{name} #{value}"
end
