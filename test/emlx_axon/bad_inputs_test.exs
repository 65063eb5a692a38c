defmodule EMLXAxon.BadInputsTest do
  # Every bad input gets a clear error naming the problem, and the VM (this
  # test process included) carries on. Complements loader_test.exs and
  # text_generation_test.exs, which cover the common cases; this module goes
  # through the native code with the rest.
  use ExUnit.Case, async: true

  alias EMLXAxon.{Error, Native, TestCheckpoint, TestFixtures, TextGeneration, Tokenizer}
  alias EMLXAxon.Qwen3.{Generate, Loader}

  @moduletag :fixtures
  @moduletag :reliability

  @fixture "qwen3-4bit-g64"

  setup_all do
    %{tokenizer: TestFixtures.tokenizer(@fixture), state: TestFixtures.model(@fixture)}
  end

  # Loads `dir` and returns the error, failing the test if loading worked.
  defp load_error(dir) do
    case Loader.load(dir) do
      {:error, %Error{} = error} -> error
      {:ok, state} -> flunk("expected loading #{dir} to fail, it loaded #{inspect(state)}")
    end
  end

  defp assert_load_error(dir, kind, pattern) do
    error = load_error(dir)
    assert error.kind == kind, "expected a #{kind} error, got: #{Exception.message(error)}"
    assert error.message =~ pattern
    error
  end

  describe "config.json" do
    test "a JSON value that is not an object" do
      dir = TestCheckpoint.scratch_copy(@fixture)
      File.write!(Path.join(dir, "config.json"), "[1, 2]")
      assert_load_error(dir, :config, "must be a JSON object")
    end

    test "each missing required key is named" do
      for key <-
            ~w(model_type hidden_size num_attention_heads num_hidden_layers intermediate_size vocab_size rope_theta) do
        dir = TestCheckpoint.scratch_copy(@fixture)
        TestCheckpoint.update_config(dir, &Map.delete(&1, key))
        assert_load_error(dir, :config, "missing required key `#{key}`")
      end
    end

    test "wrong types and values are named" do
      for {key, value, kind, pattern} <- [
            {"hidden_size", "big", :config, "`hidden_size` must be a positive integer"},
            {"hidden_size", 1.5, :config, "`hidden_size` must be a positive integer"},
            {"num_hidden_layers", -2, :config, "`num_hidden_layers` must be a positive integer"},
            {"num_hidden_layers", 0, :config, "`num_hidden_layers` must be a positive integer"},
            {"vocab_size", [151_936], :config, "`vocab_size` must be a positive integer"},
            {"intermediate_size", 2 ** 40, :config, "`intermediate_size` is too large"},
            {"num_key_value_heads", 3, :config, "must be a multiple of num_key_value_heads"},
            {"rope_theta", "fast", :config, "`rope_theta` must be a number"},
            {"rms_norm_eps", true, :config, "`rms_norm_eps` must be a number"},
            {"tie_word_embeddings", "yes", :config, "`tie_word_embeddings` must be a boolean"},
            {"eos_token_id", "eos", :config, "`eos_token_id` must hold token ids"},
            {"eos_token_id", [-1], :config, "`eos_token_id` must hold token ids"},
            {"quantization", "4bit", :config, "`quantization` must be an object"},
            {"quantization", %{"bits" => 4}, :config, "missing `group_size`"},
            {"model_type", "llama", :unsupported, "model_type `llama`"},
            {"model_type", 3, :config, "missing required key `model_type`"},
            {"rope_scaling", %{"type" => "longrope", "factor" => 4.0}, :unsupported,
             "rope_scaling type `longrope`"},
            {"rope_scaling", %{"type" => "yarn"}, :config, "yarn rope_scaling needs `factor`"},
            {"rope_scaling", %{"type" => "linear", "factor" => -1}, :config,
             "`factor` must be positive"}
          ] do
        dir = TestCheckpoint.scratch_copy(@fixture)
        TestCheckpoint.update_config(dir, &Map.put(&1, key, value))
        error = load_error(dir)

        assert error.kind == kind and error.message =~ pattern,
               "#{key}: #{inspect(value)} gave #{Exception.message(error)}"
      end
    end

    test "a layer count far beyond the weights is refused, not allocated" do
      for layers <- [2 ** 40, 2 ** 62] do
        dir = TestCheckpoint.scratch_copy(@fixture)
        TestCheckpoint.update_config(dir, &Map.put(&1, "num_hidden_layers", layers))
        # Before the fix, preallocating for the layer count aborted the VM.
        assert_load_error(dir, :missing_tensor, "model.layers.2.")
      end
    end

    test "unsupported quantization bits, group sizes and modes" do
      for {quantization, pattern} <- [
            {%{"bits" => 7, "group_size" => 64}, "quantization bits 7"},
            {%{"bits" => 1, "group_size" => 64}, "quantization bits 1"},
            {%{"bits" => 16, "group_size" => 64}, "quantization bits 16"},
            {%{"bits" => 4, "group_size" => 48}, "quantization group_size 48"},
            {%{"bits" => 4, "group_size" => 64, "mode" => "mxfp4"},
             ~s(quantization mode "mxfp4")},
            {%{
               "bits" => 4,
               "group_size" => 64,
               "model.layers.0.mlp.up_proj" => %{"bits" => 9, "group_size" => 64}
             }, "quantization bits 9"}
          ] do
        dir = TestCheckpoint.scratch_copy(@fixture)
        TestCheckpoint.update_config(dir, &Map.put(&1, "quantization", quantization))
        assert_load_error(dir, :unsupported, pattern)
      end
    end

    test "a quantization that does not match the stored weights" do
      dir = TestCheckpoint.scratch_copy(@fixture)

      TestCheckpoint.update_config(
        dir,
        &Map.put(&1, "quantization", %{"bits" => 8, "group_size" => 64})
      )

      assert_load_error(dir, :shape_mismatch, "model.embed_tokens")
    end

    test "a malformed generation_config.json is named" do
      dir = TestCheckpoint.scratch_copy(@fixture)
      File.write!(Path.join(dir, "generation_config.json"), ~s({"eos_token_id": ))
      assert_load_error(dir, :json, "generation_config.json")

      File.write!(Path.join(dir, "generation_config.json"), ~s({"eos_token_id": "x"}))
      assert_load_error(dir, :config, "eos_token_id")
    end
  end

  describe "weights" do
    test "a folder with no weights" do
      dir = TestCheckpoint.scratch_dir()

      File.cp!(
        Path.join(TestFixtures.path(@fixture), "config.json"),
        Path.join(dir, "config.json")
      )

      assert_load_error(dir, :io, "no model*.safetensors")
    end

    test "an empty, a header-only and an over-long-header file" do
      dir = TestCheckpoint.scratch_copy(@fixture)
      File.rm!(Path.join(dir, "model.safetensors.index.json"))
      path = Path.join(dir, "model.safetensors")

      File.write!(path, "")
      assert_load_error(dir, :safetensors, "model.safetensors")

      File.write!(path, <<5::little-64>>)
      assert_load_error(dir, :safetensors, "model.safetensors")

      File.write!(path, [<<1_000_000::little-64>>, "{}"])
      assert_load_error(dir, :safetensors, "model.safetensors")

      File.write!(path, [<<0xFFFF_FFFF_FFFF_FFFF::little-64>>, "{}"])
      assert_load_error(dir, :safetensors, "model.safetensors")
    end

    test "a corrupt header" do
      dir = TestCheckpoint.scratch_copy(@fixture)
      path = Path.join(dir, "model.safetensors")
      <<size::little-64, header::binary-size(size), data::binary>> = File.read!(path)
      garbage = :binary.copy("#", byte_size(header))
      File.write!(path, [<<size::little-64>>, garbage, data])
      assert_load_error(dir, :safetensors, "model.safetensors")

      # Valid JSON, but not a safetensors header.
      header = String.pad_trailing(~s({"model.norm.weight": [1, 2, 3]}), size)
      File.write!(path, [<<size::little-64>>, header, data])
      assert_load_error(dir, :safetensors, "model.safetensors")
    end

    test "a dtype the engine cannot hold is named" do
      dir = TestCheckpoint.scratch_copy(@fixture)

      TestCheckpoint.update_weights(dir, fn tensors ->
        update_tensor(tensors, "model.norm.weight", fn {name, "BF16", shape, data} ->
          {name, "F64", shape, :binary.copy(data, 4)}
        end)
      end)

      assert_load_error(dir, :safetensors, ~r/`model.norm.weight` has unsupported dtype F64/)
    end

    test "a dtype that does not match the data size" do
      dir = TestCheckpoint.scratch_copy(@fixture)

      TestCheckpoint.update_weights(dir, fn tensors ->
        update_tensor(tensors, "model.norm.weight", fn {name, "BF16", shape, data} ->
          {name, "F32", shape, data}
        end)
      end)

      assert_load_error(dir, :safetensors, "model.safetensors")
    end

    test "a missing tensor is named" do
      dir = TestCheckpoint.scratch_copy(@fixture)

      TestCheckpoint.update_weights(dir, fn tensors ->
        List.keydelete(tensors, "model.layers.1.self_attn.k_norm.weight", 0)
      end)

      assert_load_error(dir, :missing_tensor, "model.layers.1.self_attn.k_norm.weight")
    end

    test "a wrongly shaped tensor is named, also with the right element count" do
      for reshape <- [&halve/1, fn {n, d, [128], data} -> {n, d, [2, 64], data} end] do
        dir = TestCheckpoint.scratch_copy(@fixture)

        TestCheckpoint.update_weights(dir, fn tensors ->
          update_tensor(tensors, "model.norm.weight", reshape)
        end)

        assert_load_error(
          dir,
          :shape_mismatch,
          ~r/`model.norm.weight` has shape .* expected \[128\]/
        )
      end
    end

    test "a sharded index naming a missing shard, a path or no weight map" do
      dir = TestCheckpoint.scratch_copy("qwen3-4bit-g128")
      File.rm!(Path.join(dir, "model-00002-of-00002.safetensors"))
      assert_load_error(dir, :io, "model-00002-of-00002.safetensors")

      index = Path.join(dir, "model.safetensors.index.json")

      File.write!(index, ~s({"weight_map": {"model.norm.weight": "../model.safetensors"}}))
      assert_load_error(dir, :invalid_argument, "must be a plain file name")

      File.write!(index, ~s({"weight_map": {"model.norm.weight": 7}}))
      assert_load_error(dir, :json, "is not a file name")

      File.write!(index, ~s({"metadata": {}}))
      assert_load_error(dir, :json, "weight_map")

      File.write!(index, "{")
      assert_load_error(dir, :json, "model.safetensors.index.json")
    end
  end

  describe "tokenizer files" do
    test "a malformed tokenizer_config.json or generation_config.json is named" do
      for {file, content, kind} <- [
            {"tokenizer_config.json", "{ nope", :json},
            {"generation_config.json", "[", :json},
            {"generation_config.json", ~s({"eos_token_id": [1.5]}), :config}
          ] do
        dir = TestCheckpoint.scratch_copy(@fixture, ["tokenizer.json", "tokenizer_config.json"])
        File.write!(Path.join(dir, file), content)
        assert {:error, %Error{kind: ^kind, message: message}} = Tokenizer.load(dir)
        assert message =~ if(kind == :json, do: file, else: "eos_token_id")
      end
    end

    test "a broken or hostile chat template is an error, not a crash" do
      messages = [%{role: "user", content: "Hi"}]

      for template <- [
            "{% if %}",
            "{{ raise_exception('no system messages') }}",
            "{{ messages[99].content }}{{ undefined_function() }}",
            # Unbounded recursion must hit minijinja's limit before the
            # (small) stack of a dirty scheduler thread runs out.
            "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
            "{% for i in range(100000000) %}x{% endfor %}"
          ] do
        dir = TestCheckpoint.scratch_copy(@fixture, ["tokenizer.json"])

        File.write!(
          Path.join(dir, "tokenizer_config.json"),
          EMLXAxon.JSON.encode!(%{chat_template: template})
        )

        tokenizer = Tokenizer.load!(dir)

        assert {:error, %Error{kind: :template, message: message}} =
                 Tokenizer.apply_chat_template(tokenizer, messages),
               template

        assert is_binary(message) and message != ""
      end
    end
  end

  describe "generation requests" do
    test "invalid UTF-8 text is an ArgumentError naming it", %{tokenizer: tokenizer, state: state} do
      bad = <<"caf", 0xE9, "!">>

      assert_raise ArgumentError, ~r/valid UTF-8/, fn -> Tokenizer.encode(tokenizer, bad) end

      assert_raise ArgumentError, ~r/valid UTF-8/, fn ->
        TextGeneration.run(tokenizer, state, bad)
      end

      assert_raise ArgumentError, ~r/valid UTF-8/, fn ->
        TextGeneration.run(tokenizer, state, [%{role: "user", content: bad}])
      end

      assert_raise ArgumentError, ~r/valid UTF-8/, fn ->
        TextGeneration.run(tokenizer, state, "Hi", stop: [bad])
      end

      assert_raise ArgumentError, ~r/valid UTF-8/, fn ->
        Tokenizer.apply_chat_template(tokenizer, [{<<0xFF>>, "Hi"}])
      end
    end

    test "empty inputs of every form", %{tokenizer: tokenizer, state: state} do
      for input <- [
            "",
            %{text: ""},
            [],
            %{input_ids: []},
            ["ok", ""],
            [%{input_ids: [1]}, %{input_ids: []}]
          ] do
        assert_raise ArgumentError, ~r/empty/, fn ->
          TextGeneration.run(tokenizer, state, input)
        end
      end

      assert_raise ArgumentError, ~r/empty/, fn -> Generate.generate(state, []) end
      assert_raise ArgumentError, ~r/empty/, fn -> Generate.generate(state, [[1], []]) end
    end

    test "token ids outside the model's vocabulary", %{tokenizer: tokenizer, state: state} do
      for ids <- [[151_936], [1, 2 ** 32], [1, 2 ** 70]] do
        assert_raise ArgumentError, ~r/token ids to be integers from 0 to 151935/, fn ->
          TextGeneration.run(tokenizer, state, %{input_ids: ids})
        end
      end
    end

    test "a prompt longer than max_len in one row of a batch", %{
      tokenizer: tokenizer,
      state: state
    } do
      assert_raise Error, ~r/prompt_too_long.*prompt has 9 tokens but max_len is 8/, fn ->
        TextGeneration.run(
          tokenizer,
          state,
          [%{input_ids: [1]}, %{input_ids: Enum.to_list(1..9)}],
          max_len: 8
        )
      end
    end

    test "a closed stream, for every entry point", %{tokenizer: tokenizer, state: state} do
      stream = EMLXAxon.Stream.new!(:cpu)
      :ok = EMLXAxon.Stream.close(stream)

      assert {:error, %Error{kind: :closed_stream}} =
               Generate.generate(state, [1, 2], stream: stream)

      assert_raise Error, ~r/closed_stream/, fn ->
        TextGeneration.stream(tokenizer, state, "Hi", fn _ -> :ok end, stream: stream)
      end

      assert_raise Error, ~r/closed_stream/, fn ->
        EMLXAxon.Stream.with_stream(stream, fn -> TextGeneration.run(tokenizer, state, "Hi") end)
      end

      assert {:ok, %{closed: true}} = EMLXAxon.Stream.info(stream)
    end

    test "closing a stream mid-generation lets that generation finish", %{
      tokenizer: tokenizer,
      state: state
    } do
      opts = [max_new_tokens: 24, ignore_eos: true, chunk_size: 1]
      expected = TextGeneration.run(tokenizer, state, "Hello", opts).results
      stream = EMLXAxon.Stream.new!(:cpu)

      emit = fn _chunk ->
        :ok = EMLXAxon.Stream.close(stream)
      end

      assert TextGeneration.stream(tokenizer, state, "Hello", emit, opts ++ [stream: stream]).results ==
               expected

      assert_raise Error, ~r/closed_stream/, fn ->
        TextGeneration.run(tokenizer, state, "Hello", opts ++ [stream: stream])
      end
    end
  end

  describe "a tokenizer from a different model" do
    # A real, smaller model: qwen3-bf16 with its vocabulary cut to 1,000
    # tokens (the embedding is tied, so it is the only tensor to shrink).
    setup do
      dir = TestCheckpoint.scratch_copy("qwen3-bf16")
      TestCheckpoint.update_config(dir, &Map.put(&1, "vocab_size", 1000))

      TestCheckpoint.update_weights(dir, fn tensors ->
        update_tensor(tensors, "model.embed_tokens.weight", fn {name, "BF16", [_, hidden], data} ->
          {name, "BF16", [1000, hidden], binary_part(data, 0, 1000 * hidden * 2)}
        end)
      end)

      %{small: Loader.load!(dir), tokenizer: TestFixtures.tokenizer("qwen3-bf16")}
    end

    test "is refused with an error naming both vocabularies", %{
      small: small,
      tokenizer: tokenizer
    } do
      assert small.config.vocab_size == 1000
      # The small model itself works.
      assert {:ok, %{token_ids: [_, _, _, _]}} =
               Generate.generate(small, [1, 2, 3], max_new_tokens: 4, ignore_eos: true)

      assert_raise Error,
                   ~r/invalid_argument.*the tokenizer has 151669 tokens but the model only 1000/,
                   fn -> TextGeneration.run(tokenizer, small, %{input_ids: [1, 2, 3]}) end

      assert {:error, %Error{kind: :invalid_argument}} =
               Generate.generate(small, [1, 2, 3], tokenizer: tokenizer, stop: "x")
    end
  end

  describe "native functions given garbage" do
    # Every NIF, with each argument in turn replaced by terms of the wrong
    # type, released resources and resources of another type: an
    # ArgumentError (or an error tuple where the type is right but the value
    # is not), never a crash and never success.
    setup %{tokenizer: tokenizer, state: state} do
      {:ok, stream} = Native.stream_new(:cpu)
      {:ok, closed} = Native.stream_new(:cpu)
      :ok = Native.stream_close(closed)
      {:ok, freed} = Native.generation_start(state.ref, nil, nil, [[1]], native_opts())
      :ok = Native.generation_free(freed)
      {:ok, gen} = Native.generation_start(state.ref, nil, nil, [[1]], native_opts())
      on_exit(fn -> Native.generation_free(gen) end)

      refs = %{model: state.ref, tokenizer: tokenizer.ref, stream: stream, generation: gen}
      %{refs: refs, closed: closed, freed: freed}
    end

    test "resources of the wrong type, random references and pids", %{refs: refs} = context do
      garbage =
        [make_ref(), self(), :erlang.list_to_pid(~c"<0.0.0>"), fn -> :ok end, 1, "ref"] ++
          Map.values(refs) ++ [context.closed, context.freed]

      calls = calls(refs)

      tried =
        for {fun, args, types} <- calls,
            {:resource, type, index} <- Enum.with_index(types) |> Enum.map(&resource_slot/1),
            bad <- garbage,
            not same_resource_type?(bad, type, refs, context) do
          args = List.replace_at(args, index, bad)

          result = call(fun, args)

          assert match?(%ArgumentError{}, result),
                 "#{fun} with #{inspect(bad)} as its #{type} returned #{inspect(result)}"
        end

      assert length(tried) > 100
    end

    test "plain arguments of the wrong type", %{refs: refs} do
      garbage = [make_ref(), self(), :atom, -1, 2 ** 70, 1.5, <<0xFF>>, [1, :x], %{a: 1}, {1, 2}]

      tried =
        for {fun, args, types} <- calls(refs),
            {type, index} <- Enum.with_index(types),
            not match?({:resource, _}, type),
            bad <- garbage,
            not accepted?(type, bad) do
          args = List.replace_at(args, index, bad)

          result = call(fun, args)

          assert rejected?(result),
                 "#{fun} with #{inspect(bad)} for #{inspect(type)} returned #{inspect(result)}"
        end

      assert length(tried) > 100
    end

    test "options out of range are refused by the engine itself", %{refs: refs} do
      for {key, value, pattern} <- [
            {:max_new_tokens, 0, "max_new_tokens"},
            {:max_len, 0, "max_len"},
            {:temperature, -1.0, "temperature"},
            {:top_p, 0.0, "top_p"},
            {:top_p, 1.5, "top_p"},
            {:min_p, 1.5, "min_p"},
            {:sampler, :beam, "sampler"},
            {:stop, [""], "stop strings"}
          ] do
        opts = Map.put(native_opts(), key, value)

        assert {:error, {:invalid_argument, message}} =
                 Native.generation_start(refs.model, refs.tokenizer, nil, [[1]], opts),
               "#{key}: #{inspect(value)}"

        assert message =~ pattern
      end

      # Wrong types inside the options map: rustler names the field.
      for {key, value} <- [top_k: -1, max_new_tokens: -5, seed: -1, eos_token_ids: [-1]] do
        opts = Map.put(native_opts(), key, value)

        assert_raise ErlangError, ~r/Could not decode field :#{key}/, fn ->
          Native.generation_start(refs.model, nil, nil, [[1]], opts)
        end
      end

      assert_raise ArgumentError, fn ->
        Native.generation_start(refs.model, nil, nil, [[1]], Map.delete(native_opts(), :top_p))
      end
    end

    test "forged structs reach the NIF as ArgumentErrors", %{tokenizer: tokenizer, state: state} do
      forged_state = %{state | ref: make_ref()}
      forged_tokenizer = %{tokenizer | ref: self()}

      assert_raise ArgumentError, fn -> TextGeneration.run(tokenizer, forged_state, "Hi") end
      assert_raise ArgumentError, fn -> TextGeneration.run(forged_tokenizer, state, "Hi") end
      assert_raise ArgumentError, fn -> Generate.generate(forged_state, [1]) end

      assert_raise ArgumentError, fn ->
        EMLXAxon.Stream.info(%EMLXAxon.Stream{ref: state.ref, device: :cpu})
      end
    end
  end

  defp call(fun, args) do
    apply(Native, fun, args)
  rescue
    e in [ArgumentError, ErlangError] -> e
  end

  # An ArgumentError for a bad argument, an ErlangError naming the field for a
  # bad field of an options map, or an error tuple for a value of the right
  # type that the engine refuses.
  defp rejected?(%ArgumentError{}), do: true
  defp rejected?(%ErlangError{original: "Could not decode field" <> _}), do: true
  defp rejected?({:error, {kind, message}}), do: is_atom(kind) and is_binary(message)
  defp rejected?(_other), do: false

  defp native_opts, do: TestFixtures.native_opts()

  # {function, valid arguments, argument types}; a resource type is
  # {:resource, name}.
  defp calls(refs) do
    messages = ~s([{"role": "user", "content": "Hi"}])
    model = {:resource, :model}
    tokenizer = {:resource, :tokenizer}
    stream = {:resource, :stream}
    generation = {:resource, :generation}

    [
      {:model_load,
       ["/no/such/model", %{dtype: nil, quantize_bits: nil, quantize_group_size: nil}],
       [:string, :map]},
      {:model_info, [refs.model], [model]},
      {:tokenizer_load, ["/no/such/tokenizer"], [:string]},
      {:tokenizer_encode, [refs.tokenizer, "Hi", false], [tokenizer, :string, :boolean]},
      {:tokenizer_decode, [refs.tokenizer, [1, 2], true], [tokenizer, :ids, :boolean]},
      {:tokenizer_apply_chat_template, [refs.tokenizer, messages, nil, true, nil],
       [tokenizer, :json, :optional_json, :boolean, :optional_boolean]},
      {:tokenizer_info, [refs.tokenizer], [tokenizer]},
      {:stream_new, [:cpu], [:atom]},
      {:stream_close, [refs.stream], [stream]},
      {:stream_info, [refs.stream], [stream]},
      {:generation_start, [refs.model, refs.tokenizer, refs.stream, [[1]], native_opts()],
       [model, tokenizer, stream, :prompts, :map]},
      {:generation_next, [refs.generation, 1], [generation, :count]},
      {:generation_stats, [refs.generation], [generation]},
      {:generation_free, [refs.generation], [generation]}
    ]
  end

  defp resource_slot({{:resource, type}, index}), do: {:resource, type, index}
  defp resource_slot({type, index}), do: {:plain, type, index}

  # Garbage that happens to be a live resource of the expected type is not
  # garbage (a closed stream and a freed generation are errors, tested
  # elsewhere, not ArgumentErrors).
  defp same_resource_type?(bad, type, refs, context) do
    bad == refs[type] or
      (type == :stream and bad == context.closed) or
      (type == :generation and bad == context.freed)
  end

  # Garbage of the right type: the value is then the engine's to judge.
  defp accepted?(:atom, bad), do: is_atom(bad)
  defp accepted?(:count, bad), do: is_integer(bad) and bad >= 0 and bad < 2 ** 64
  defp accepted?(_type, _bad), do: false

  defp update_tensor(tensors, name, fun) do
    tensor = List.keyfind(tensors, name, 0) || flunk("no tensor #{name}")
    List.keyreplace(tensors, name, 0, fun.(tensor))
  end

  defp halve({name, dtype, [n], data}),
    do: {name, dtype, [div(n, 2)], binary_part(data, 0, div(byte_size(data), 2))}
end
